"""A sharded parameter between uses: one honest tensor of its real shape.

Between two uses a ZeRO-3 parameter holds only this rank's flat, padded
1/N slice of its values. A module that registered an empty placeholder
there would lie to every torch function that reads the parameter outside a
module's forward: a penalty computed before the forward, an EMA, a fused
loss that takes ``lm_head.weight`` into its own ``autograd.Function``,
``parameters_to_vector``, a parameter count. So between uses a module holds
a ``ShardedTensor`` instead (a ``ShardedParam``, which is also an
``nn.Parameter``): a tensor with the parameter's logical shape, dtype and
device whose values are this rank's shard, and whose ``__torch_function__``
decides, in this one place, what torch may do with it. While a module runs,
the runtime registers the plain gathered parameter in its place, so the hot
path and torch.compile see ordinary tensors (FSDP2 swaps its DTensor and
unsharded parameters the same way).

Note: what torch does with a sharded tensor.
    - Metadata (shape, dtype, device, ``numel``, ``requires_grad``, ...): the
      logical answers.
    - Elementwise functions whose tensor operands share its layout (another
      sharded tensor of the same size and world, a tensor of its logical
      shape, of which this rank takes its slice, or a one-element tensor)
      and scalars: run on the shards, with no communication. In place
      (``mul_``, ``add_``, ``lerp_``, ``copy_``, ``zero_``, the ``_foreach``
      forms an EMA uses) they write this rank's shard and its fp32 master,
      then tell the owner (``ShardAccess.wrote``) so no stale gathered copy
      survives; out of place, without autograd, they give a new sharded
      tensor.
    - Anything else (``F.linear``, a matmul, ``pow().sum()``, ``norm``, a
      custom ``autograd.Function`` that computes with it) needs the whole
      value: the owner gathers it (a collective: every rank must do the
      same, and the owner's agreement names a rank that does not), and the
      function runs on the full tensor. Under autograd the full value is
      differentiable and its gradient arrives in the sharded tensor's
      ``.grad`` through torch's own accumulation, where the owner takes it
      into the parameter's gradient partition, as a module's use would.
    - What cannot be right is refused with ``ShardedValueError``, naming
      the way: pickling or ``torch.save`` of a shard as if it were the
      whole, a storage or pointer, random in-place fills (each rank would
      draw another slice of the numbers than the unsharded model draws), and
      in-place functions that are not elementwise.
    - ``.data`` is a sharded tensor of the same values without autograd
      (writes through it are writes to the shard), ``.grad`` and
      ``requires_grad`` are the parameter's own (``ShardAccess``), and
      ``copy.deepcopy`` gives an independent sharded tensor of the same
      values (an EMA or a reference model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from z3kit.partition import partition_of, shard_numel_for


class ShardedValueError(RuntimeError):
    """A function was refused on a sharded tensor: the message says why and what to use."""


@attrs.frozen
class ShardSpec:
    """Where a sharded tensor's values are: ``numel`` logical elements of
    ``shape``, flattened and padded to ``world`` equal slices; this rank holds
    slice ``rank``."""

    shape: torch.Size
    rank: int = attrs.field(validator=attrs.validators.ge(0))
    world: int = attrs.field(validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        return shard_numel_for(self.numel, self.world)

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's flat padded slice of ``full`` (a tensor of the logical shape), a new tensor."""
        return partition_of(full.detach().reshape(-1), self.rank, self.world)


class ShardAccess(Protocol):
    """What a sharded tensor asks of the runtime that owns its values."""

    def full_values(self, t: ShardedTensor) -> torch.Tensor:
        """``t``'s whole value in its logical shape, without autograd (collective)."""

    def in_forward(self, t: ShardedTensor) -> torch.Tensor | None:
        """The gathered parameter a module's forward uses in ``t``'s place when
        one runs now (its gradient then flows as any module use's); else None."""

    def write(self, t: ShardedTensor, apply: Callable[[torch.Tensor], None]) -> None:
        """``apply`` writes ``t``'s shard in place (given the tensor to write:
        its fp32 master where it has one, see ``write_shard``)."""

    def parameter(self, t: ShardedTensor) -> nn.Parameter | None:
        """The plain parameter whose ``.grad`` and ``requires_grad`` ``t``
        answers with (None: ``t`` answers with its own)."""

    def master(self, t: ShardedTensor) -> torch.Tensor | None:
        """``t``'s fp32 master shard, where it has one apart from its shard."""


def write_shard(t: ShardedTensor, apply: Callable[[torch.Tensor], None], master: torch.Tensor | None) -> None:
    """``apply`` in place on ``t``'s shard: on ``master`` (fp32) first where
    there is one, whose values are then rounded into the shard."""
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        if master is not None:
            apply(master)
            t._local.copy_(master)
        else:
            apply(t._local)


class ShardedTensor(torch.Tensor):
    """A tensor of a logical shape whose values are this rank's shard (see the module docstring)."""

    _spec: ShardSpec
    #: this rank's flat padded slice, in the tensor's dtype
    _local: torch.Tensor
    #: the fp32 master shard kept in step with in-place writes (None: ``_local`` is all there is)
    _master: torch.Tensor | None
    _access: ShardAccess
    #: the runtime's parameter this tensor stands for (its ``wrote`` and ``.grad`` refer to it); None for copies
    _home: Any

    @staticmethod
    def __new__(cls, spec: ShardSpec, local: torch.Tensor, access: ShardAccess, *, master: torch.Tensor | None = None,
                home: Any = None, requires_grad: bool = False) -> ShardedTensor:
        if local.dim() != 1 or local.numel() != spec.shard_numel:
            raise ValueError(f"a shard of {tuple(spec.shape)} over {spec.world} ranks has {spec.shard_numel} "
                             f"elements, got a tensor of shape {tuple(local.shape)}")
        out: ShardedTensor = torch.Tensor._make_wrapper_subclass(
            cls, spec.shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad)
        out._spec, out._local, out._master, out._access, out._home = spec, local, master, access, home
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @property
    def spec(self) -> ShardSpec:
        return self._spec

    def full_tensor(self) -> torch.Tensor:
        """The whole value in the logical shape, as a plain tensor (collective:
        every rank calls it; differentiable where the tensor requires grad).
        DTensor's name for the same."""
        out: torch.Tensor = _whole(self)
        return out

    @property
    def local(self) -> torch.Tensor:
        """This rank's flat padded slice (a view of the runtime's shard: no copy)."""
        return self._local

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        kind = "ShardedParam" if isinstance(self, nn.Parameter) else "ShardedTensor"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"{kind}(shape={tuple(self._spec.shape)}, dtype={self.dtype}, device={self.device}, shard "
                f"{self._spec.rank} of {self._spec.world}{grad}: values are gathered by the functions that need them)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ShardedValueError(_refusal("pickling (torch.save)"))

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedTensor:
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        cls = ShardedParam if isinstance(self, nn.Parameter) else ShardedTensor
        master = self._access.master(self)
        master = None if master is None else master.detach().clone()
        with torch._C.DisableTorchFunctionSubclass():
            requires_grad = bool(self.requires_grad)
            local = self._local.detach().clone()
        out = cls(self._spec, local, self._access, master=master, requires_grad=requires_grad)
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Iterable[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name_of(func)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        special = _SPECIAL.get(name)
        if special is not None and isinstance(args[0], ShardedTensor):
            return special(func, args, kwargs)
        if name in _REFUSED:
            raise ShardedValueError(_refusal(f"{name}()"))
        if isinstance(kwargs.get("out"), ShardedTensor):  # out= writes around the owner: refused, however elementwise
            raise _not_elementwise_in_place(f"{name}(..., out=param)")
        if name in _RANDOM_FILLS:
            raise ShardedValueError(
                f"{name}() on a sharded parameter: each rank would draw its own slice of the numbers, not those of "
                "the unsharded model; fill it inside engine.gathered_parameters(modifier_rank=0), or before "
                "zero3.initialize")
        if name in _ELEMENTWISE or name.startswith("_foreach_"):
            done = _elementwise(func, name, args, kwargs)
            if done is not _NOT_ELEMENTWISE:
                return done
        writes_shard = (name.endswith("_") and not name.endswith("__") or name == "__setitem__") and \
            _first_tensor_is_sharded(args)
        if writes_shard:
            raise _not_elementwise_in_place(name)  # computed on a gathered copy, the write would be lost
        return _compute(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Iterable[type], args: tuple[Any, ...] = (),  # type: ignore[override]
                           kwargs: dict[Any, Any] | None = None) -> Any:
        # every use is decided in __torch_function__; one that reaches the dispatcher came in a way it did not see
        raise ShardedValueError(
            f"{func} reached a sharded parameter below torch's function layer (a C++ path or a mode that "
            "bypasses __torch_function__); read its values with engine.gathered_parameters() or model.state_dict()")


class ShardedParam(ShardedTensor, nn.Parameter):
    """A ``ShardedTensor`` that is an ``nn.Parameter``: what a module holds between uses."""


# -- the rules (see the module Note) ------------------------------------------------------------------------

_METADATA = frozenset({
    "shape", "dtype", "device", "layout", "is_leaf", "grad_fn", "is_cuda", "is_cpu", "is_meta", "is_sparse",
    "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps", "size", "dim", "ndim", "numel", "nelement",
    "element_size", "itemsize", "nbytes", "is_floating_point", "is_complex", "is_signed", "__len__", "names",
    "output_nr", "_version", "_base", "is_inference", "ndimension", "get_device", "is_contiguous", "_is_view",
    "__hash__", "name", "requires_grad", "stride",
})

_REFUSED = frozenset({
    "untyped_storage", "storage", "_typed_storage", "storage_offset", "__reduce_ex__",
    "__getstate__", "__setstate__", "set_", "resize_", "as_strided", "as_strided_", "share_memory_",
    "pin_memory", "__dlpack__",
})

_RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
                           "cauchy_", "log_normal_"})

#: functions that are elementwise over their tensor operands (in place where the name ends in ``_``)
_ELEMENTWISE = frozenset({
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "true_divide", "true_divide_", "lerp", "lerp_",
    "addcmul", "addcmul_", "addcdiv", "addcdiv_", "copy_", "zero_", "fill_", "clamp", "clamp_", "clamp_min",
    "clamp_min_", "clamp_max", "clamp_max_", "neg", "neg_", "abs", "abs_", "sqrt", "sqrt_", "sign", "sign_", "exp",
    "exp_", "log", "log_", "reciprocal", "reciprocal_", "sigmoid", "sigmoid_", "tanh", "tanh_", "square",
    "square_", "rsqrt", "rsqrt_", "maximum", "minimum", "where", "masked_fill", "masked_fill_", "nan_to_num",
    "nan_to_num_", "clone", "contiguous", "to", "float", "double", "half", "bfloat16", "type_as", "__add__",
    "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__",
    "__itruediv__", "__neg__", "pow", "pow_", "__pow__", "__ipow__", "mul_scalar", "sgn", "floor_divide",
    "zeros_like", "ones_like", "empty_like", "full_like",
})

_NOT_ELEMENTWISE = object()


def _name_of(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__", "__delete__"):  # a property of Tensor: name the property and the access
        prop = getattr(getattr(func, "__self__", None), "__name__", name)
        return prop if name == "__get__" else f"{prop}{name}"
    return str(name)


def _refusal(what: str) -> str:
    return (f"{what} of a sharded parameter: this rank holds only its 1/N shard, not the whole value. Save and "
            "read whole values with model.state_dict() or engine.full_state_dict() (every rank), or inside "
            "engine.gathered_parameters()")


def _first_tensor_is_sharded(args: Sequence[Any]) -> bool:
    return bool(args) and isinstance(args[0], ShardedTensor)


def _not_elementwise_in_place(name: str) -> ShardedValueError:
    return ShardedValueError(
        f"in-place {name if '(' in name else name + '()'} on a sharded parameter is not elementwise over its "
        "shards; write it inside "
        "engine.gathered_parameters(modifier_rank=0), or use an elementwise form (copy_, add_, mul_, lerp_)")


def _check_leaf_in_place(target: ShardedTensor) -> None:
    """Refuse an in-place write under autograd to a sharded tensor that requires grad, as torch refuses it."""
    if torch.is_grad_enabled() and _requires_grad(target) and target.is_leaf:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")


# -- elementwise on the shards ------------------------------------------------------------------------------

def _aligned(spec: ShardSpec, value: Any) -> torch.Tensor | None | object:
    """``value`` as an operand on ``spec``'s shards: a sharded tensor's local
    slice, this rank's slice of a tensor of the logical shape, a one-element
    tensor as it is, a non-tensor as it is; ``_NOT_ELEMENTWISE`` otherwise."""
    if isinstance(value, ShardedTensor):
        other = value._spec
        if other.numel != spec.numel or other.world != spec.world or other.rank != spec.rank:
            return _NOT_ELEMENTWISE
        return value._local
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() <= 1 and not value.requires_grad:
            return value
        if tuple(value.shape) == tuple(spec.shape) and not (torch.is_grad_enabled() and value.requires_grad):
            return spec.local_slice(value)
        return _NOT_ELEMENTWISE
    kept: object = value
    return kept


_CONVERSIONS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _unchanged_by(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """A conversion of ``args[0]`` to the dtype and device it has already (torch returns the tensor itself)."""
    t = args[0]
    if not isinstance(t, ShardedTensor):
        return False
    if name == "contiguous":
        return True
    if name in _CONVERSIONS:
        return _CONVERSIONS[name] == t.dtype
    if name == "type_as":
        return isinstance(args[1], torch.Tensor) and args[1].dtype == t.dtype and args[1].device == t.device
    if name != "to" or kwargs.get("copy", False):
        return False
    try:
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
    except TypeError:
        return False
    return (dtype is None or dtype == t.dtype) and (device is None or torch.device(device) == t.device)


def _elementwise(func: Callable[..., Any], name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if name.startswith("_foreach_"):
        return _foreach(func, name, args, kwargs)
    if _unchanged_by(name, args, kwargs):
        return args[0]
    sharded = [a for a in (*args, *kwargs.values()) if isinstance(a, ShardedTensor)]
    spec = sharded[0]._spec
    inplace = name.endswith("_") and not name.startswith("__") or name in ("__iadd__", "__isub__", "__imul__",
                                                                          "__itruediv__", "__ipow__")
    target = args[0] if args else None
    if inplace and not isinstance(target, ShardedTensor):
        return _NOT_ELEMENTWISE  # a plain tensor written from sharded operands: computed on the whole
    needs_grad = torch.is_grad_enabled() and any(_requires_grad(a) for a in sharded)
    if inplace:
        assert isinstance(target, ShardedTensor)
        _check_leaf_in_place(target)
    elif needs_grad:
        return _NOT_ELEMENTWISE  # autograd needs the whole value: computed on it
    local_args = [_aligned(spec, a) for a in args]
    local_kwargs = {k: _aligned(spec, v) for k, v in kwargs.items()}
    if any(a is _NOT_ELEMENTWISE for a in (*local_args, *local_kwargs.values())):
        return _NOT_ELEMENTWISE
    if inplace:
        assert isinstance(target, ShardedTensor)
        _write(target, func, local_args[1:], local_kwargs)
        return target
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        out = func(*local_args, **local_kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.numel() != spec.shard_numel:
        return _NOT_ELEMENTWISE
    return ShardedTensor(spec, out, sharded[0]._access)


def _write(target: ShardedTensor, func: Callable[..., Any], operands: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """``func`` in place on ``target``'s shard, through its owner."""
    def apply(values: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            func(values, *operands, **kwargs)

    target._access.write(target, apply)


def _foreach(func: Callable[..., Any], name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``torch._foreach_*``: elementwise per position. A position whose
    operands all share its first sharded tensor's layout runs on the shards;
    any other is computed on the whole values, except an in-place one whose
    target is sharded: refused, as the non-foreach form is."""
    is_list = [isinstance(a, (list, tuple)) for a in args]
    if not any(is_list):
        return _NOT_ELEMENTWISE
    length = len(next(a for a, listed in zip(args, is_list) if listed))
    inplace = name.endswith("_")
    results = []
    for i in range(length):
        row = [a[i] if listed else a for a, listed in zip(args, is_list)]
        sharded = [x for x in row if isinstance(x, ShardedTensor)]
        out: Any = _NOT_ELEMENTWISE
        if inplace and isinstance(row[0], ShardedTensor):
            _check_leaf_in_place(row[0])
        if sharded and not (torch.is_grad_enabled() and any(_requires_grad(x) for x in sharded)) and (
                not inplace or isinstance(row[0], ShardedTensor)):
            spec = sharded[0]._spec
            aligned = [_aligned(spec, x) for x in row]
            if all(x is not _NOT_ELEMENTWISE for x in aligned):
                def per_position(first: torch.Tensor, *rest: Any, **kw: Any) -> Any:
                    operands = [[x] if listed else x for x, listed in zip((first, *rest), is_list)]
                    return func(*operands, **kw)

                if inplace:
                    _write(row[0], per_position, aligned[1:], kwargs)  # row[0] is sharded: checked above
                    continue
                with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                    local = per_position(*aligned, **kwargs)[0]  # type: ignore[arg-type]
                out = ShardedTensor(spec, local, sharded[0]._access)
        if out is _NOT_ELEMENTWISE:
            if inplace and isinstance(row[0], ShardedTensor):
                raise _not_elementwise_in_place(name)  # a gathered copy written would be lost
            computed = _compute(func, [[x] if listed else x for x, listed in zip(row, is_list)], kwargs)
            out = None if inplace else computed[0]
        if not inplace:
            results.append(out)
    return None if inplace else results


def _requires_grad(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return bool(t.requires_grad)


# -- computed on the whole value -----------------------------------------------------------------------------

class _Gathered(torch.autograd.Function):
    """The whole value of a sharded tensor, differentiable: the gradient goes
    back to the sharded tensor itself (its ``.grad``, where the owner takes it)."""

    @staticmethod
    def forward(ctx: Any, t: ShardedTensor) -> torch.Tensor:
        return t._access.full_values(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _whole(t: ShardedTensor) -> torch.Tensor:
    plain = t._access.in_forward(t)
    if plain is not None:
        return plain
    if torch.is_grad_enabled() and _requires_grad(t):
        out: torch.Tensor = _Gathered.apply(t)  # type: ignore[no-untyped-call]
        return out
    return t._access.full_values(t)


def _replace(value: Any) -> Any:
    if isinstance(value, ShardedTensor):
        return _whole(value)
    if type(value) is list or type(value) is tuple:
        return type(value)(_replace(v) for v in value)
    return value


def _compute(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return func(*_replace(tuple(args)), **{k: _replace(v) for k, v in kwargs.items()})


# -- the special attributes -----------------------------------------------------------------------------------

def _detach(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> ShardedTensor:
    t: ShardedTensor = args[0]
    return ShardedTensor(t._spec, t._local, t._access, master=t._master, home=t._home)


def _data_ptr(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The shard's address: the same for every name of one parameter, another for every other (what
    libraries compare it for); no whole value lies behind it."""
    t: ShardedTensor = args[0]
    return int(t._local.data_ptr())


def _data_set(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    if args[1] is args[0]:  # Module._apply's conversion to the dtype and device it has: nothing changes
        return
    raise ShardedValueError(
        "assigning .data of a sharded parameter would put another tensor in place of its shard (model.half(), "
        "model.to(dtype) or model.to(device) after zero3.initialize do this): the engine computes in "
        "Zero3Config.compute_dtype on the device it was initialized on, so set those at initialize. To write "
        "values: param.copy_(values) (elementwise on the shards), or inside engine.gathered_parameters(modifier_rank=0)")


def _grad_get(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    t: ShardedTensor = args[0]
    plain = t._access.parameter(t)
    with torch._C.DisableTorchFunctionSubclass():
        return t.grad if plain is None else plain.grad


def _grad_set(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    t: ShardedTensor = args[0]
    plain = t._access.parameter(t)
    with torch._C.DisableTorchFunctionSubclass():
        if plain is None:
            t.grad = args[1]
        else:
            plain.grad = args[1]


def _requires_grad_set(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    t: ShardedTensor = args[0]
    flag = bool(args[1]) if len(args) > 1 else bool(kwargs.get("requires_grad", True))
    plain = t._access.parameter(t)
    with torch._C.DisableTorchFunctionSubclass():
        t.requires_grad_(flag)
        if plain is not None:
            plain.requires_grad_(flag)
    return t


def _hook(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A gradient hook the user registers: on the plain parameter, where module uses' gradients arrive."""
    t: ShardedTensor = args[0]
    plain = t._access.parameter(t)
    with torch._C.DisableTorchFunctionSubclass():
        return func(t if plain is None else plain, *args[1:], **kwargs)


_SPECIAL: dict[str, Callable[[Callable[..., Any], Sequence[Any], dict[str, Any]], Any]] = {
    "detach": _detach,
    "data": _detach,
    "data__set__": _data_set,
    "data_ptr": _data_ptr,
    "grad": _grad_get,
    "_grad": _grad_get,
    "grad__set__": _grad_set,
    "_grad__set__": _grad_set,
    "requires_grad__set__": _requires_grad_set,
    "requires_grad_": _requires_grad_set,
    "register_hook": _hook,
    "register_post_accumulate_grad_hook": _hook,
}


def parameter_of(t: torch.Tensor) -> torch.Tensor:
    """The runtime's plain parameter that a sharded parameter stands for between uses; any other tensor itself."""
    if isinstance(t, ShardedTensor):
        plain = t._access.parameter(t)
        if plain is not None:
            return plain
    return t


def take_accumulated_grad(t: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd accumulated in a sharded tensor's own ``.grad``
    (not the parameter's, which ``.grad`` answers with), taken out of it."""
    with torch._C.DisableTorchFunctionSubclass():
        grad = t.grad
        t.grad = None
    return grad


__all__ = ["ShardAccess", "ShardSpec", "ShardedParam", "ShardedTensor", "ShardedValueError", "parameter_of", "take_accumulated_grad"]
