"""Typed errors. Each names what is wrong (file, tensor, flag) and what to do about it.

The CLI turns any `LuceboxError` into one line on stderr and exit code 2.
"""

from __future__ import annotations


class LuceboxError(Exception):
    """Base class of every error lucebox raises on purpose."""


class InvalidArgumentError(LuceboxError, ValueError):
    """A keyword argument or CLI flag has a value lucebox cannot use."""


class JSONInputError(InvalidArgumentError):
    """A JSON text from outside (a request, a saved chat, a bench result, a config) that is not JSON, or
    is past one of the bounds every such text is read within (`lucebox.bounded_json`): its size, its
    nesting, the length of a number. The message names the text."""


class ModelNotFoundError(LuceboxError, FileNotFoundError):
    """The model folder, or a file it must contain, does not exist."""


class ConfigError(LuceboxError):
    """config.json (or a related JSON file) is unreadable or inconsistent."""


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture is not one lucebox implements."""


class CheckpointError(LuceboxError):
    """The weight files cannot be used as they are."""


class PickleCheckpointError(CheckpointError):
    """Only pickle weights (*.bin, *.pt) were found; lucebox never unpickles."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file has a broken header or data that does not match it."""


class MissingTensorError(CheckpointError):
    """A tensor the architecture needs is absent from the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds tensors the architecture does not use."""


class TensorShapeError(CheckpointError):
    """A tensor's shape differs from what config.json implies."""


class TensorDtypeError(CheckpointError):
    """A tensor has a dtype its weight cannot have (an integer tensor where a float weight belongs)."""


class TokenizerError(LuceboxError):
    """The tokenizer files are missing or unusable."""


class DraftModelError(LuceboxError):
    """A drafter cannot serve this target (format, vocabulary, shapes, captured layers)."""


class NonFiniteLogitsError(LuceboxError):
    """The model produced NaN or inf logits: broken weights or impossible config values."""


class ContextLengthError(LuceboxError):
    """A request needs more tokens of context than the engine was opened with, or the context asked
    for needs more memory (offloaded KV) than the machine has."""


class InsufficientMemoryError(LuceboxError, MemoryError):
    """The weights (the target's and a drafter's) or the fixed-size caches (rings, the device KV
    pool, a drafter's `draft_ctx` rings) need more memory than is free; found by the memory plan
    before anything is allocated."""


class CacheRewindError(LuceboxError):
    """A cache was asked to go back to a position it cannot return to exactly (a recurrent layer's
    state folds in every row it saw: only its own length, or 0, can be returned to)."""


class SpeculationUnsupportedError(InvalidArgumentError):
    """Speculative decoding was asked for in a form a model cannot run yet (on a target with
    recurrent (Gated DeltaNet) layers: a draft model with recurrent layers, or draft trees); the
    message names what to pass instead."""


class GrammarError(InvalidArgumentError):
    """A `json_schema`, `grammar` or JSON mode that the grammar engine cannot compile, or a value that is
    not a JSON Schema; `field` names the argument (the server's 400 names it as its `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class BackendError(LuceboxError):
    """The kernel backend asked for cannot run here (no Triton, no interpreter, unsupported dtype)."""


class LuceboxWarning(UserWarning):
    """Something runs, but not as the model was made to (a context past its trained length, ...);
    the CLI prints it as one `lucebox: warning:` line."""


class ToolError(InvalidArgumentError):
    """`tools`, `tool_choice` or `parallel_tool_calls` that cannot be used; `field` names the argument
    (the server's `param`); `status` is the server's answer: 422 for a value of the wrong shape, 400 for
    a well-formed one that cannot be served (a schema the grammar engine refuses, a tool not given, a
    model with no call syntax); `code` the server's error code, if any."""

    def __init__(self, field: str, message: str, status: int = 422, code: str | None = None):
        super().__init__(message)
        self.field, self.status, self.code = field, status, code
