"""User models: ``--model path/to/file.py:build`` or ``--model package.module:build``.

The contract (see ``examples/user_model.py``): ``build`` is a function taking any of the
keyword arguments ``preset``, ``seed``, ``data``, ``dropout`` and the user's own
``--model-option`` keys, and returning either a :class:`~gradsync.models.base.Workload` or a
tuple ``(model, dataset, loss)``. ``dataset`` is either a gradsync
:class:`~gradsync.data.base.Dataset` or a map-style torch dataset (``__len__`` and
``__getitem__`` returning ``(input, target)``), which is sampled deterministically by epoch
permutations seeded by (seed, epoch).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

from gradsync.data.base import Batch, Dataset, IndexedSamples
from gradsync.errors import UserError
from gradsync.models.base import BuildRequest, Workload
from gradsync.models.lookup_reads import LookupReads

DEFAULT_USER_GLOBAL_BATCH = 32


def is_user_model(name: str) -> bool:
    """``file.py:fn`` and ``pkg.mod:fn`` name user models; registry names have no colon."""
    return ":" in name


def same_model(recorded: str, given: str) -> bool:
    """Whether two ``--model`` values name one model: a model file by another path to it
    (relative here, absolute there) is the same file.

    Example:
        >>> import os
        >>> same_model(os.path.abspath("m.py") + ":build", "m.py:build"), same_model("a", "b")
        (True, False)
    """
    return recorded == given or _located(recorded) == _located(given)


def _located(name: str) -> str:
    """A model file's ``--model`` value with the file's absolute path; others as given."""
    location, _, function_name = name.rpartition(":")
    if not location.endswith(".py"):
        return name
    return f"{Path(location).resolve()}:{function_name}"


def _describe(error: BaseException) -> str:
    """An import error as a reader wants it: the kind, where (file:line), the message.

    Example:
        >>> try:
        ...     compile("def build(:", "model.py", "exec")
        ... except SyntaxError as error:
        ...     print(_describe(error))
        SyntaxError at model.py:1 (column 11): invalid syntax
    """
    if isinstance(error, SyntaxError):
        column = f" (column {error.offset})" if error.offset else ""
        return f"{type(error).__name__} at {error.filename}:{error.lineno}{column}: {error.msg}"
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}{where}: {error}"


def _load_function(name: str) -> Callable[..., Any]:
    location, _, function_name = name.rpartition(":")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise UserError(f"user model file {path} does not exist; pass --model FILE.py:FUNCTION")
        spec = importlib.util.spec_from_file_location(f"gradsync_user_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except SystemExit as error:  # sys.exit() in a model file is not a way to build one
            raise UserError(
                f"user model file {path} called sys.exit({error.code!r}) while being imported; "
                "a model file defines a build function and returns"
            ) from None
        except Exception as error:
            raise UserError(
                f"user model file {path} failed to import: {_describe(error)}; fix it and rerun"
            ) from None
    else:
        try:
            module = importlib.import_module(location)
        except SystemExit as error:
            raise UserError(
                f"user model module '{location}' called sys.exit({error.code!r}) on import"
            ) from None
        except Exception as error:
            raise UserError(
                f"cannot import user model module '{location}': {_describe(error)}"
            ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(
            f"'{function_name}' is not a function in {location}; pass --model {location}:FUNCTION"
        )
    return function


def build_user_workload(name: str, request: BuildRequest, *, load_only: bool = False) -> Workload:
    """Import and call the user's build function; adapt its result into a Workload."""
    build = _load_function(name)
    options = {key.replace("-", "_"): value for key, value in request.options.items()}
    available = {
        "preset": request.preset,
        "seed": request.seed,
        "data": request.data,
        "dropout": request.dropout,
        **options,
    }
    parameters = inspect.signature(build).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [key for key in options if key not in parameters and not takes_any]
    if unknown:
        raise UserError(
            f"user model {name} takes no option {', '.join(unknown)}; its parameters: "
            f"{', '.join(parameters)}"
        )
    kwargs = {k: v for k, v in available.items() if takes_any or k in parameters}
    required = [
        key
        for key, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and key not in kwargs
    ]
    if required:
        raise UserError(
            f"user model {name} requires '{required[0]}', which gradsync does not pass; give "
            f"it a default, or pass it with --model-option {required[0]}=VALUE"
        )
    if load_only:
        return None  # type: ignore[return-value]
    try:
        result = build(**kwargs)
    except SystemExit as error:
        raise UserError(
            f"user model {name} called sys.exit({error.code!r}) instead of returning "
            "(model, dataset, loss)"
        ) from None
    except UserError:
        raise
    except Exception as error:  # the user's code: one line, not its traceback
        raise UserError(
            f"user model {name} raised {type(error).__name__} while building: {error}; fix "
            "the function (calling it in Python shows the traceback)"
        ) from None
    if isinstance(result, Workload):
        _check_model_and_loss(name, result.model, result.dataset, result.loss)
        return _checked_workload(name, result)
    if not (isinstance(result, tuple) and len(result) == 3):
        raise UserError(
            f"user model {name} must return a Workload or (model, dataset, loss), "
            f"got {type(result).__name__}; return (model, dataset, loss_fn), e.g. "
            "(nn.Linear(8, 3), dataset, F.cross_entropy) (README: Your own model)"
        )
    model, dataset, loss = result
    _check_model_and_loss(name, model, dataset, loss)
    if not isinstance(dataset, Dataset):
        dataset = MapStyleSamples(dataset, seed=request.seed, owner=name)
    workload = Workload(
        model=model,
        dataset=dataset,
        loss=loss,
        global_batch=DEFAULT_USER_GLOBAL_BATCH,
        description=name,
    )
    return _checked_workload(name, workload)


def _check_model_and_loss(name: str, model: Any, dataset: Any, loss: Any) -> None:
    if not isinstance(model, torch.nn.Module) or not callable(loss):
        raise UserError(
            f"user model {name} must return (model, dataset, loss) with an nn.Module and a "
            f"callable loss, got ({type(model).__name__}, {type(dataset).__name__}, "
            f"{type(loss).__name__})"
        )


def _checked_workload(name: str, workload: Workload) -> Workload:
    """``workload`` (its model and loss checked already) when it can train: trainable
    parameters, a dataset that gives batches, a positive global batch; else a UserError."""
    model, dataset = workload.model, workload.dataset
    if not callable(getattr(dataset, "batch", None)):
        raise UserError(
            f"user model {name}'s Workload has no dataset with a batch method (got "
            f"{type(dataset).__name__}); return a gradsync Dataset or a map-style dataset"
        )
    batch = workload.global_batch
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise UserError(
            f"user model {name}'s Workload has global_batch {batch!r}; give a positive integer"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(
            f"user model {name} has no trainable parameters, so there is nothing to "
            "synchronize; return a model with parameters"
        )
    return workload


class MapStyleSamples(IndexedSamples):
    """Global batches from a map-style torch dataset of ``(input, target)`` items.

    Example:
        >>> import torch
        >>> items = [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(10)]
        >>> len(MapStyleSamples(items, seed=0).batch(step=0, size=4, start=0, stop=4))
        4
    """

    def __init__(self, dataset: Any, *, seed: int, owner: str = "a user model") -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UserError(
                f"{owner}'s dataset must be a gradsync Dataset or a map-style "
                "dataset with __len__ and __getitem__ returning (input, target)"
            )
        try:
            count = len(dataset)
        except Exception as error:  # the user's __len__
            raise UserError(f"{owner}'s dataset has no length: {_describe(error)}") from None
        if count == 0:
            raise UserError(f"{owner}'s dataset is empty; return one with samples")
        super().__init__(count, seed)
        self.dataset, self.owner = dataset, owner

    def gather(self, indices: Tensor) -> Batch:
        inputs, targets = default_collate([self.dataset[int(i)] for i in indices])
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if not (isinstance(inputs, (tuple, list)) and all(isinstance(t, Tensor) for t in inputs)):
            raise UserError(self._unsupported_inputs(inputs))
        return Batch(inputs=tuple(inputs), targets=targets)

    def _unsupported_inputs(self, inputs: object) -> str:
        """Why a collated input is refused: the model is called as ``model(*inputs)``."""
        if isinstance(inputs, Mapping):
            keys = ", ".join(map(str, inputs))
            what, fix = f"a dict (keys {keys})", f"the tuple ({keys}) and forward({keys})"
        else:
            what, fix = type(inputs).__name__, "a tensor, or a tuple of tensors"
        return (
            f"{self.owner}'s dataset items have {what} as their input, but gradsync calls the "
            f"model with the input tensors as positional arguments (model(*inputs)); "
            f"return {fix} as the input of each (input, target) item"
        )


@dataclass(frozen=True)
class UserStep:
    """What one forward and loss of a user model did besides computing: the trainable
    parameters it changed in place, and the lookup tables it read other than by looking up
    its module's input (:class:`~gradsync.models.lookup_reads.LookupReads`)."""

    edited: set[str]
    tables_read_elsewhere: set[str]


def _failed_step(name: str, error: Exception, samples: int) -> str:
    """One line for a forward or loss that raised on the launcher's check: what the check
    does, the error (cut short), how to fix it; a dtype error says how to fix that.

    Example:
        >>> error = RuntimeError("mat1 and mat2 must have the same dtype")
        >>> print(_failed_step("m.py:build", error, 4))  # doctest: +ELLIPSIS
        user model m.py:build failed the check before launch (forward and loss on the 4 ...
    """
    text = " ".join(str(error).split())[:200]
    line = (
        f"user model {name} failed the check before launch (forward and loss on the {samples} "
        f"samples a worker takes in step 0): {type(error).__name__}: {text}; make "
        "model(inputs) and loss(output, targets) run on its samples"
    )
    if "dtype" in text or "Double" in text or "Half" in text:
        line += (
            ", parameters in the default dtype (float32, or --dtype's): no .half(), .double() "
            "or .to(dtype) in the builder"
        )
    return line


def check_user_step(name: str, workload: Workload, *, samples: int = 2) -> UserStep:
    """Run one forward pass and loss on the first ``samples`` of step 0 (a worker's shard);
    UserError unless the loss is a scalar tensor that has a gradient. Runs in the launcher,
    before any rank starts. Returns the trainable parameters the forward or the loss changed
    in place (their version moved), and the lookup tables they read other than by a lookup
    of their module's input.

    Example:
        >>> # check_user_step("my_model.py:build", build_user_workload(name, request), samples=16)
    """
    samples = max(1, samples)
    try:
        batch = workload.dataset.batch(step=0, size=samples, start=0, stop=samples)
    except UserError:
        raise
    except Exception as error:  # the user's __getitem__, or items that do not stack
        message = f"user model {name}'s dataset failed to give a batch of {samples} samples"
        raise UserError(f"{message}: {_describe(error)}"[:400]) from None
    params = [(n, p) for n, p in workload.model.named_parameters() if p.requires_grad]
    versions = [p._version for _, p in params]
    from gradsync.probe import lookup_tables  # probe imports this package

    try:
        with LookupReads(lookup_tables(workload.model)) as reads:
            output = workload.model(*batch.inputs, **batch.shared)
            loss = workload.loss(output, batch.targets)
    except Exception as error:
        raise UserError(_failed_step(name, error, samples)) from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserError(
            f"user model {name}'s loss returned {shape}, not a scalar tensor; return the mean "
            "over the batch (e.g. cross_entropy(output, targets))"
        )
    if not loss.requires_grad:
        raise UserError(
            f"user model {name}'s loss has no gradient (it does not depend on the parameters, "
            "or was computed under no_grad / with .item()); return a tensor from the model's output"
        )
    edited = {n for (n, p), v in zip(params, versions, strict=True) if p._version != v}
    return UserStep(edited=edited, tables_read_elsewhere=reads.elsewhere)
