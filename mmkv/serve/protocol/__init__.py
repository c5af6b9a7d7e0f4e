"""The OpenAI chat-completions protocol as ``mmkv serve`` speaks it: the request (``request``), every response
object (``response``) and the errors with their HTTP status (``errors``), as pydantic models.

Nothing is silently ignored: every documented request field is declared and either honoured or refused with a
400 that names it (``REFUSED``); a field nobody documents gets OpenAI's own answer, 400 "Unrecognized request
argument supplied: <name>". The README's Serve section has the table of every field.
"""

from .errors import (
    ApiError,
    BadRequest,
    Busy,
    ErrorBody,
    InternalError,
    MethodNotAllowed,
    NotFound,
    RequestTimeout,
    Timeout,
    TooLarge,
    Unauthorized,
    error_from_validation,
)
from .request import REFUSED, ChatCompletionRequest, ImagePart, MmkvOptions, NamedToolChoice, TextPart
from .response import (
    AssistantOut,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionTokenLogprob,
    Choice,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)

__all__ = [
    "REFUSED",
    "ApiError",
    "AssistantOut",
    "BadRequest",
    "Busy",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "ChoiceDelta",
    "ErrorBody",
    "FunctionCallOut",
    "FunctionDelta",
    "ImagePart",
    "InternalError",
    "MethodNotAllowed",
    "MmkvOptions",
    "NamedToolChoice",
    "NotFound",
    "PromptTokensDetails",
    "RequestTimeout",
    "TextPart",
    "Timeout",
    "ChatCompletionTokenLogprob",
    "TooLarge",
    "ToolCallDelta",
    "ToolCallOut",
    "TopLogprob",
    "Unauthorized",
    "Usage",
    "error_from_validation",
]
