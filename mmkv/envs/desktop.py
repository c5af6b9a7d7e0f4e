"""``DesktopApp``: a small simulated ticket desk an agent acts on through tools, one screenshot per state.

The app shows a queue of 2-4 tickets, one at a time. Each ticket screen has a status badge (red or green) and
a ``note`` form field (empty, or filled). The policy (the system message, with the suite's ``account_role``
field) says what to do; the right call depends on

- the current screen: a dialog is closed with ``click(ok)``; on a ticket, the badge and the field decide;
- the policy text: under a red badge an admin approves and anyone else escalates; ``fill`` types the role;
- what happened earlier: a ticket the agent escalated can come back later (the same screen again, pixel for
  pixel), and must then be closed; a field typed into by an earlier step stays filled (so ``submit`` follows);
  closing a dialog can sign the agent in again under another role, which every later decision must follow.

Transitions (right calls)::

    ticket, returning                  --click(close)-->         next ticket
    ticket, red, admin                 --click(approve)-->       dialog --click(ok)--> next ticket
    ticket, red, other role            --escalate(ticket)-->     next ticket (may come back 1-2 tickets later)
    ticket, green, empty field         --fill(note, <role>)-->   same ticket, field filled
    ticket, green, filled field        --click(submit)-->        dialog --click(ok)--> next ticket

A wrong call changes nothing ("Error: ... is not allowed here.", the same screenshot). An episode ends when
the queue is empty (4-10 right steps), or after ``max_steps`` calls. Episodes are deterministic per
``(seed, split)``. Pictures are split as in the task suite (``mmkv.synthetic.picture_split``): at reset every
screen the episode can show (wrong calls show nothing new) is drawn so that its pixel hash lies in the app's
split, so no held-out episode shows a picture of a training episode or of a training sample of the suite.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from PIL import Image

from ..synthetic import Split
from ..toolcalls import FunctionCall
from .screens import dialog_in_split, render_done, render_ticket, ticket_look_in_split
from .tools import tool_specs

__all__ = ["POLICY", "DesktopApp", "Observation", "StepResult"]

POLICY = (
    "Policy. account_role: {role}. On a ticket: if the status badge is red, an admin clicks approve and anyone "
    "else escalates the ticket; if it is green, fill the note field with your account_role when it is empty, "
    "else click submit. In a dialog click ok. A ticket you escalated that comes back: click close."
)
TASK = "Work through the ticket queue."
ROLES = ("admin", "viewer")
MIN_STEPS, MAX_STEPS = 4, 10  # right steps per episode
SLACK_STEPS = 3  # wrong calls allowed beyond the right path before an episode is cut off


@dataclass(frozen=True, slots=True)
class Observation:
    """What the agent sees after a reset or an action."""

    text: str  # the task (after a reset) or the action's result
    image: Image.Image  # the screenshot now


@dataclass(frozen=True, slots=True)
class StepResult:
    """What ``DesktopApp.step`` returns."""

    text: str  # the action's result, as a tool message says it
    image: Image.Image  # the screenshot after the action
    is_right: bool  # the call was the one the policy prescribes here
    done: bool  # the episode is over (queue empty, or max_steps reached)
    expected: FunctionCall  # the call that was right
    kind: str  # the decision's kind: approve, escalate, fill, submit, ok, close
    uses_history: (
        bool  # the right call depended on an earlier step (a returning ticket, a role signed in again)
    )


@dataclass
class _Ticket:
    ticket_id: int
    red: bool
    prefilled: bool
    returns_after: int | None  # if escalated, back after this many other tickets (None: never)
    field_text: str = ""


@dataclass
class _State:
    role: str
    tickets: dict[int, _Ticket]
    queue: list[int]  # ticket ids in the order they are shown (a returning one appears twice)
    position: int = 0  # index into queue of the open ticket
    dialog: str = ""  # the open dialog's message ("" for none)
    escalated: set[int] = field(default_factory=set)
    role_change_at: int | None = None  # the dialog close (0-based count) that signs in under the other role
    role_changed: bool = False
    num_oks: int = 0

    @property
    def is_done(self) -> bool:
        return self.position >= len(self.queue)

    @property
    def ticket(self) -> _Ticket:
        return self.tickets[self.queue[self.position]]


def _expected(state: _State) -> tuple[FunctionCall, str, bool]:
    """The right call in ``state``, its kind and whether it depends on an earlier step."""
    if state.dialog:
        return FunctionCall("click", {"target": "ok"}), "ok", False
    ticket = state.ticket
    if ticket.ticket_id in state.escalated:
        return FunctionCall("click", {"target": "close"}), "close", True
    if ticket.red:
        if state.role == "admin":
            return FunctionCall("click", {"target": "approve"}), "approve", state.role_changed
        return FunctionCall("escalate", {"item": "ticket"}), "escalate", state.role_changed
    if ticket.field_text:
        return FunctionCall("click", {"target": "submit"}), "submit", False
    return FunctionCall("fill", {"field": "note", "text": state.role}), "fill", state.role_changed


def _advance(state: _State) -> str:
    state.position += 1
    return " The queue is empty." if state.is_done else f" Opened ticket {state.queue[state.position]}."


def _apply(state: _State, kind: str) -> str:
    """Carry out the right call of ``kind``; returns the result text. Changes ``state``."""
    ticket = state.ticket
    if kind in ("approve", "submit"):
        state.dialog = "Approved" if kind == "approve" else "Submitted"
        return _dialog_text(state.dialog, ticket.ticket_id)
    if kind == "fill":
        ticket.field_text = state.role
        return f"Typed {state.role} into note."
    if kind == "ok":
        state.dialog, text = "", "Closed the dialog."
        if state.num_oks == state.role_change_at:
            state.role = ROLES[1 - ROLES.index(state.role)]
            state.role_changed = True
            text += f" Signed in again: account_role is now {state.role}."
        state.num_oks += 1
        return text + _advance(state)
    if kind == "escalate":
        state.escalated.add(ticket.ticket_id)
        if ticket.returns_after is not None:
            back = min(len(state.queue), state.position + 1 + ticket.returns_after)
            state.queue.insert(back, ticket.ticket_id)
        return f"Escalated ticket {ticket.ticket_id}." + _advance(state)
    assert kind == "close", kind
    state.escalated.discard(ticket.ticket_id)
    return f"Closed ticket {ticket.ticket_id}." + _advance(state)


def _draw_state(rng: random.Random) -> _State:
    """A fresh episode's state (no pictures yet)."""
    ids = rng.sample(range(100, 1000), rng.randint(2, 4))
    tickets = {
        i: _Ticket(
            i, rng.random() < 0.5, rng.random() < 0.4, rng.randint(1, 2) if rng.random() < 0.6 else None
        )
        for i in ids
    }
    for t in tickets.values():
        t.field_text = "draft" if t.prefilled else ""  # differs from any typed role: another picture
    change = rng.randrange(3) if rng.random() < 0.35 else None
    return _State(rng.choice(ROLES), tickets, list(ids), role_change_at=change)


@dataclass(frozen=True, slots=True)
class _RightPath:
    """What playing an episode right from its start shows (computed on a copy of the state)."""

    num_steps: int  # right calls to the empty queue
    field_texts: dict[int, list[str]]  # per ticket, the field's texts its screens show (opening text first)
    dialogs: list[tuple[int, str]]  # (ticket id, dialog message) of every dialog shown


def _right_path(state: _State) -> _RightPath:
    import copy

    state, steps, dialogs = copy.deepcopy(state), 0, []
    texts = {i: [t.field_text] for i, t in state.tickets.items()}
    while not state.is_done:
        ticket = state.ticket
        _apply(state, _expected(state)[1])
        steps += 1
        if ticket.field_text not in texts[ticket.ticket_id]:
            texts[ticket.ticket_id].append(ticket.field_text)
        if state.dialog:
            dialogs.append((ticket.ticket_id, _dialog_text(state.dialog, ticket.ticket_id)))
    return _RightPath(steps, texts, dialogs)


def _dialog_text(message: str, ticket_id: int) -> str:
    return f"{message} ticket {ticket_id}."


class DesktopApp:
    """The simulated ticket desk. ``reset(seed)`` starts an episode; ``step`` acts. Not thread-safe."""

    def __init__(self, split: Split = "train") -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        self.split = split
        self._state: _State | None = None
        self._pictures: dict[tuple[str, int, str], Image.Image] = {}  # (screen, ticket, text) -> picture
        self.seed: int | None = None
        self._start_role = ""  # the account_role the policy states
        self.num_steps = 0  # calls made this episode
        self.num_wrong = 0  # of which wrong
        self.right_path_steps = 0  # right calls the episode needs
        self.max_steps = 0  # calls after which the episode is cut off

    # ------------------------------------------------------------------------------------------ the episode
    def reset(self, seed: int) -> Observation:
        """Start the episode of ``seed`` (deterministic per ``(seed, split)``); returns the task and the first
        screenshot."""
        rng = random.Random(f"mmkv-desktop/{self.split}/{seed}")
        for _ in range(10_000):
            state = _draw_state(rng)
            path = _right_path(state)
            if MIN_STEPS <= path.num_steps <= MAX_STEPS:
                break
        else:  # pragma: no cover - the draw above gives a fitting episode within a few tries
            raise RuntimeError("no episode of 4-10 steps drawn")
        # every picture the episode can show, drawn in the app's split (wrong calls show nothing new)
        self._pictures = {}
        for ticket_id, texts in path.field_texts.items():
            look = ticket_look_in_split(ticket_id, state.tickets[ticket_id].red, texts, rng, self.split)
            self._pictures |= {("ticket", ticket_id, text): render_ticket(look, text) for text in texts}
        for ticket_id, text in path.dialogs:
            self._pictures["dialog", ticket_id, text] = dialog_in_split(text, rng, self.split)
        self._pictures["done", 0, ""] = render_done(rng, self.split)
        self._state, self.seed, self._start_role = state, seed, state.role
        self.num_steps = self.num_wrong = 0
        self.right_path_steps, self.max_steps = path.num_steps, path.num_steps + SLACK_STEPS
        return Observation(f"{TASK} Opened ticket {state.queue[0]}.", self.screenshot())

    @property
    def policy(self) -> str:
        """The system message: the policy with the episode's starting ``account_role``."""
        self._require()
        return POLICY.format(role=self._start_role)

    @property
    def role(self) -> str:
        """The ``account_role`` in force now."""
        return self._require().role

    @property
    def done(self) -> bool:
        """The episode is over: the queue is empty or ``max_steps`` calls were made."""
        return self._require().is_done or self.num_steps >= self.max_steps

    @property
    def success(self) -> bool:
        """The queue was emptied without a wrong call."""
        return self._require().is_done and self.num_wrong == 0

    def tools(self) -> list[dict]:
        """The app's actions as OpenAI function tool specs (a fresh copy)."""
        return tool_specs()

    def expected_call(self) -> FunctionCall | None:
        """The call the policy prescribes now (``None`` once the episode is over)."""
        return None if self.done else _expected(self._require())[0]

    def screenshot(self) -> Image.Image:
        """The current screen (the same picture object whenever a screen re-appears)."""
        state = self._require()
        if state.is_done:
            return self._pictures["done", 0, ""]
        ticket = state.ticket
        if state.dialog:
            return self._pictures["dialog", ticket.ticket_id, _dialog_text(state.dialog, ticket.ticket_id)]
        return self._pictures["ticket", ticket.ticket_id, ticket.field_text]

    def step(self, name: str, arguments: dict | None = None) -> StepResult:
        """Carry out the call ``name(**arguments)``. A right call moves the app on; a wrong one changes nothing
        but the step count. Raises ``RuntimeError`` once the episode is over."""
        if self.done:
            raise RuntimeError("the episode is over: call reset(seed) to start another")
        state = self._require()
        expected, kind, uses_history = _expected(state)
        call = FunctionCall(str(name), dict(arguments or {}))
        is_right = call == expected
        self.num_steps += 1
        if is_right:
            text = _apply(state, kind)
        else:
            self.num_wrong += 1
            text = f"Error: {call} is not allowed here."
        return StepResult(text, self.screenshot(), is_right, self.done, expected, kind, uses_history)

    def _require(self) -> _State:
        if self._state is None:
            raise RuntimeError("call reset(seed) first")
        return self._state
