"""The demo's agent episode: the simulated ticket desk (``mmkv.envs.DesktopApp``) driven by the model through tool
calls, one ``mmkv.Session`` per episode, testable without a browser.

Each step is one turn of a tool loop: the session answers the conversation as it stands (``ask(None)``, decoding
kept to a call of a listed tool by the grammar), the first call is executed on the app, and its result (the
text and the next screenshot) is added as the tool message; the session keeps the last ``window`` screenshots in
the prompt. Every step records the call, whether it was the right one, the tool result's text, the account_role
in force after it, the time to first token and where each image's KV came from, and what the same step costs
without reuse: a ``reuse="none"`` twin of the conversation (``app.backend.NoReuseTwin``: its own live prefix, no
stores) is brought up to the same prompt just before each step and timed. A reuse policy asked for mid-episode
(``request_reuse``) applies from the next step. Example::

    from app.backend import DemoBackend
    from app.episode import EpisodeRun

    run = EpisodeRun(DemoBackend("tiny-qwen3-vl"))
    run.reset(seed=3)
    step = run.step()              # AgentStep(number=1, call="click(target=ok)", is_right=False, ...)
    run.request_reuse("encoder")   # from the next step on
    steps = run.run()              # the remaining steps, to the end of the episode
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from PIL import Image

from mmkv import Answer, PrefillStats, Session
from mmkv.envs import DesktopApp, FunctionCall
from mmkv.policy import REUSE_POLICIES, ReusePolicy
from mmkv.runtime.grammar import tool_calls

from .backend import DemoBackend, NoReuseTwin

__all__ = ["AgentStep", "EpisodeRun", "EpisodeSettings"]

MAX_CALL_TOKENS = 96  # a call is ~22 tokens with the retrained tokenizer, longer with the tiny ones


@dataclass(frozen=True)
class EpisodeSettings:
    """How an episode is run. Validated on construction."""

    split: str = "heldout"  # "heldout": pictures never shown in training; "train"
    window: int = (
        3  # screenshots kept in the prompt (the agents' pattern; the checkpoints were trained on 2-4)
    )
    reuse: ReusePolicy = "kv"  # the session's reuse policy

    def __post_init__(self) -> None:
        if self.split not in ("heldout", "train"):
            raise ValueError(f"split must be 'heldout' or 'train', got {self.split!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.reuse not in REUSE_POLICIES:
            raise ValueError(f"reuse must be one of {REUSE_POLICIES}, got {self.reuse!r}")


@dataclass(frozen=True)
class AgentStep:
    """One step of the episode: the model's call, its outcome, and what the turn cost."""

    number: int  # 1-based
    call: str  # the call the model made, ``click(target=ok)`` form
    expected: str  # the call the policy prescribed
    is_right: bool  # they are equal
    kind: str  # the decision's kind (approve, escalate, fill, submit, ok, close)
    result: str  # the app's answer (the tool result's text)
    screenshot: Image.Image  # the screen after the call
    answer: Answer  # the turn (TTFT, prompt / reused tokens, where each image came from)
    reuse: ReusePolicy  # the policy the step was answered with
    reuse_was: ReusePolicy | None  # the policy before, on the first step under a changed one; else None
    role: str  # the account_role in force after the call (a dialog's close can sign in again as another)
    no_reuse: PrefillStats  # the same step's prompt on the reuse="none" twin (its own live prefix, no stores)

    @property
    def ttft_ms(self) -> float:
        """Time to first token, in milliseconds."""
        return self.answer.ttft_s * 1e3

    @property
    def no_reuse_ms(self) -> float:
        """What the same step's prefill took without reuse (the ``none`` twin), in milliseconds."""
        return self.no_reuse.seconds * 1e3


class EpisodeRun:
    """One browser session's episode: the app, the session acting on it and the steps so far. Not thread-safe on
    its own; every model call holds the backend's lock."""

    def __init__(self, backend: DemoBackend, settings: EpisodeSettings | None = None) -> None:
        self.backend = backend
        self.settings = settings or EpisodeSettings()
        self.app = DesktopApp(self.settings.split)
        self.session: Session | None = None
        self.seed: int | None = None
        self.first_screenshot: Image.Image | None = None
        self.steps: list[AgentStep] = []
        self.stopped = (
            False  # the model's last answer made no call (cut off at the token bound): nothing to do
        )
        self.twin: NoReuseTwin | None = None  # the conversation under reuse="none", timed before each step
        self.start_role = ""  # the account_role the policy (the system message) states
        self.pending_reuse: ReusePolicy | None = None  # asked for mid-episode: applied at the next step
        self._grammar = None

    def __deepcopy__(self, memo: dict) -> EpisodeRun:  # gr.State copies the initial value per browser session
        return EpisodeRun(self.backend, self.settings)

    @property
    def started(self) -> bool:
        """Whether an episode was reset."""
        return self.session is not None

    @property
    def done(self) -> bool:
        """The episode is over (queue empty, the app's step bound, or an answer without a call), or none was
        started."""
        return not self.started or self.stopped or self.app.done

    @property
    def screenshot(self) -> Image.Image | None:
        """The screen now (None before a reset)."""
        return self.app.screenshot() if self.started else None

    def reset(self, seed: int, settings: EpisodeSettings | None = None) -> Image.Image:
        """Start the episode of ``seed`` (with ``settings``, else the current ones); returns the first screenshot.
        The shared stores keep their entries, so a replayed episode's screenshots are cache hits."""
        self.settings = settings or self.settings
        self.app = DesktopApp(self.settings.split)
        first = self.app.reset(int(seed))
        tools = self.app.tools()
        with self.backend.lock:
            handle = self.backend.load()
            session = Session(handle, store=self.backend.kv_store, reuse=self.settings.reuse,
                              window=self.settings.window, encoder_store=self.backend.encoder_store, tools=tools)  # fmt: skip
            twin = NoReuseTwin(handle, window=self.settings.window, tools=tools)
            for conversation in (session, twin):
                conversation.add_text(self.app.policy, role="system")
                conversation.add_text(first.text, role="user")
                conversation.add_image(first.image)
        self.session, self.seed, self.first_screenshot, self.steps = session, int(seed), first.image, []
        self.twin, self.start_role, self.pending_reuse = twin, self.app.role, None
        self.stopped = False
        self._grammar = tool_calls(tools, "required")
        return first.image

    @property
    def reuse(self) -> ReusePolicy:
        """The reuse policy the next step is answered with (a pending change included)."""
        return self.pending_reuse or self.settings.reuse

    def request_reuse(self, reuse: ReusePolicy) -> None:
        """Answer from the next step on with ``reuse`` (before a reset: the policy the next reset uses). Nothing
        is computed now; asking for the policy in force cancels a pending change. Raises ``ValueError`` for a
        policy not in ``REUSE_POLICIES``."""
        if reuse not in REUSE_POLICIES:
            raise ValueError(f"reuse must be one of {REUSE_POLICIES}, got {reuse!r}")
        if not self.started:
            self.settings = replace(self.settings, reuse=reuse)
        self.pending_reuse = None if reuse == self.settings.reuse else reuse

    def step(self) -> AgentStep:
        """One turn: the model's call (a listed tool, its arguments valid), executed on the app, its result and
        the next screenshot added as the tool message. Raises ``RuntimeError`` when no episode runs or it is
        over."""
        if self.done:
            raise RuntimeError("the episode is over: start a new one")
        expected = self.app.expected_call()
        with self.backend.lock:
            # 1. a policy asked for since the last step: the session forked under it (a new, empty live cache)
            reuse_was = self._apply_pending_reuse()
            # 2. the same prompt without reuse, on the twin (its own live prefix, no stores)
            no_reuse = self.twin.prefill()
            # 3. the model's call under the policy
            answer = self.session.ask(None, max_new_tokens=MAX_CALL_TOKENS, grammar=self._grammar)
            costs = dict(answer=answer, reuse=self.settings.reuse, reuse_was=reuse_was, no_reuse=no_reuse)
            if not answer.tool_calls:  # the call was cut off at the token bound (random weights): no action
                self.stopped = True
                step = AgentStep(len(self.steps) + 1, "", str(expected), False, "", "(no call: the answer was cut "
                                 "off)", self.app.screenshot(), role=self.app.role, **costs)  # fmt: skip
                self.steps.append(step)
                return step
            # 4. executed on the app; its result and the next screenshot added to both conversations
            call = answer.tool_calls[0]  # the grammar makes the answer one call
            arguments = _arguments(call.arguments)
            outcome = self.app.step(call.name, arguments)
            self.session.add_tool_result(call.id, outcome.text, images=[outcome.image])
            self.twin.add_tool_calls(answer.tool_calls)
            self.twin.add_tool_result(call.id, outcome.text, images=[outcome.image])
        step = AgentStep(len(self.steps) + 1, str(FunctionCall(call.name, arguments)), str(expected), outcome.is_right,
                         outcome.kind, outcome.text, outcome.image, role=self.app.role, **costs)  # fmt: skip
        self.steps.append(step)
        return step

    def _apply_pending_reuse(self) -> ReusePolicy | None:
        """Switch the session to the pending policy, if any (``Session.fork``: the conversation kept, the live
        cache empty); returns the policy it had, else None."""
        if self.pending_reuse is None:
            return None
        was = self.settings.reuse
        self.session = self.session.fork(reuse=self.pending_reuse)
        self.settings, self.pending_reuse = replace(self.settings, reuse=self.pending_reuse), None
        return was

    def run(self, max_steps: int | None = None):
        """Steps to the end of the episode (or ``max_steps`` of them), yielding each as it is made."""
        while not self.done and (max_steps is None or max_steps > 0):
            yield self.step()
            max_steps = None if max_steps is None else max_steps - 1


def _arguments(text: str) -> dict:
    """A call's arguments text as a mapping (``{}`` when it is not a JSON object: cut off at the token bound)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
