# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""Imperative, mutable ``State`` objects that trace into pure, cached JAX programs.

Write ``state.value += x`` in ordinary Python and still use ``jit``, ``vmap``,
``grad`` and ``scan``.  A :class:`StatefulFunction` traces a function that reads
and writes :class:`State` objects into a ``ClosedJaxpr`` whose extra inputs and
outputs are those states, caches it per abstract argument signature, and calls
it as a compiled XLA executable.  :class:`StatefulMapping` maps such a function
over a batch (``jax.vmap``, ``jax.pmap`` or a shard_map-style mapper) with
per-state batch axes and per-lane random keys.

The module is one self-contained file that depends on ``jax`` only; copy it
into your project.  It reads top to bottom as data flows:

1. compatibility shims (every JAX internal the module touches lives there),
2. errors and small helpers,
3. ``State``, its subclasses and the ``StateTraceStack`` recorder,
4. state filters,
5. the bounded LRU cache and argument keys,
6. the tracing core,
7. ``StatefulFunction``,
8. ``make_jaxpr``,
9. ``StatefulMapping``,
10. inspecting and shipping: labelled jaxprs, cache-miss explanations, export,
11. jaxpr passes (constant folding),
12. a demo ``main()`` (``python stateful_jaxpr.py``).

Example
-------
>>> import jax.numpy as jnp
>>> counter = State(jnp.zeros(()), name='counter')
>>> @StatefulFunction
... def step(x):
...     counter.value = counter.value + x
...     return counter.value * 2
>>> float(step(1.0)), float(counter.value)
(2.0, 1.0)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import inspect
import itertools
import json
import logging
import math
import operator
import os
import random as _pyrandom
import re
import sys
import threading
import warnings
import weakref
import collections
from collections import OrderedDict
from collections.abc import MutableSet
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    # states
    'State', 'ShortTermState', 'LongTermState', 'ParamState', 'BatchState',
    'HiddenState', 'RandomState', 'TreefyState', 'catch_new_states', 'check_state_value_tree',
    # trace stack
    'StateTraceStack',
    # cache
    'BoundedCache', 'make_hashable', 'hashabledict',
    # tracing
    'StatefulFunction', 'make_jaxpr',
    # inspecting and shipping
    'explain_cache_misses', 'export', 'deserialize', 'Exported',
    # mapping and filters
    'StatefulMapping', 'to_predicate', 'OfType', 'WithTag', 'Any', 'All', 'Not',
    'Everything', 'Nothing',
    # jaxpr passes
    'constant_fold_jaxpr', 'IdentitySet',
    # errors
    'TraceContextError', 'BatchAxisError',
]


# =============================================================================
# 1. Compatibility shims
#
# Tracing over States needs what JAX keeps private: new inputs for the jaxpr
# being traced, the current trace, mutable references, primitive names and
# ``params`` keys.  Only this section touches them, each through ``_probe``
# (has JAX the name?) or ``_takes`` (has the function the parameter?), with
# the releases measured (0.4.30 .. 0.12.0.1) in a comment.
# =============================================================================

import jax.extend.core as _jex_core               # all releases
import jax.extend.linear_util as _lu              # all releases
import jax.extend.source_info_util as _siu        # all releases
from jax.interpreters import partial_eval as _pe  # all releases
import jax._src.core as _src_core                 # all releases


def _probe(*paths):
    """The first of the ``'module:attr.attr'`` paths this JAX has, else None."""
    for path in paths:
        module, _, attrs = path.partition(':')
        try:
            return functools.reduce(getattr, attrs.split('.'), importlib.import_module(module))
        except (ImportError, AttributeError):
            pass
    return None


def _takes(fun, parameter: str) -> bool:
    return fun is not None and parameter in inspect.signature(fun).parameters


ClosedJaxpr, Jaxpr = _jex_core.ClosedJaxpr, _jex_core.Jaxpr   # one class from 0.11
Literal, Var, _jaxpr_as_fun = _jex_core.Literal, _jex_core.Var, _jex_core.jaxpr_as_fun
_typeof = _probe('jax:typeof', 'jax.api_util:shaped_abstractify')    # 0.5.3 .. | before
_find_top_trace = _probe('jax.extend.core:find_top_trace',          # 0.10 .. | before
                         'jax._src.core:find_top_trace')
_STACKLESS = _probe('jax._src.core:trace_ctx') is not None      # 0.4.36 ..
_CONSTS_ON_JAXPR = _probe('jax.extend.core:Jaxpr.with_consts') is not None   # 0.11 ..
_make_debug_info = _probe('jax.api_util:debug_info')           # 0.5.1 ..
_extend_axis_env = _probe('jax._src.core:extend_axis_env_nd')  # all releases
_AXIS_EXPLICIT = _probe('jax.sharding:AxisType.Explicit')      # 0.5 ..
_reshard = _probe('jax.sharding:reshard', 'jax.experimental.shard:reshard')  # 0.7 | 0.5 ..
_MAKE_JAXPR_HAS_ABSTRACTED_AXES = _takes(jax.make_jaxpr, 'abstracted_axes')  # .. 0.8.1


def _close(jaxpr, consts):
    if _CONSTS_ON_JAXPR:
        return jaxpr.with_consts(list(consts))
    return ClosedJaxpr(jaxpr, list(consts))


def _rebuild(jaxpr, consts, like=None, **fields):
    """``jaxpr`` with ``fields`` replaced, closed over ``consts`` (open if None,
    before 0.11), with the debug info of ``like`` (default ``jaxpr``)."""
    fields.setdefault('debug_info', getattr(jaxpr if like is None else like, 'debug_info', None))
    if _CONSTS_ON_JAXPR:
        return jaxpr.replace(consts=list(consts), **fields)
    new = jaxpr.replace(**fields)
    return new if consts is None else ClosedJaxpr(new, list(consts))


def _current_trace_id():
    if _STACKLESS:
        return _src_core.trace_ctx.trace
    return _src_core.thread_local_state.trace_state.trace_stack.stack[-1]


def _tracer_trace_id(tracer):
    return tracer._trace if _STACKLESS else tracer._trace.main


def _under_jax_trace() -> bool:
    if _STACKLESS:
        return not isinstance(_src_core.trace_ctx.trace, _src_core.EvalTrace)
    return len(_src_core.thread_local_state.trace_state.trace_stack.stack) > 1


_NEW_ARG_TAKES_SOURCE_INFO = _takes(   # 0.6.1 ..
    _probe('jax._src.interpreters.partial_eval:DynamicJaxprTrace.new_arg'), 'source_info')


def _new_arg(trace, aval):
    """Adds a fresh input of abstract value ``aval`` to the jaxpr ``trace`` builds."""
    if _NEW_ARG_TAKES_SOURCE_INFO:
        return trace.new_arg(aval, _siu.current())
    return trace.new_arg(aval)


# Replaying a cached jaxpr into a jit trace.  ``inline_jaxpr_into_trace``
# (all releases; ``src``, the call's source info, from 0.6) copies the
# equations without redoing their abstract evaluation, as jax.jit does for an
# inlined call: at 1,000 states that is a tenth of a first call.  The copies
# keep their name stack; the source line they carry is the caller's.
_inline_jaxpr = _probe('jax._src.interpreters.partial_eval:inline_jaxpr_into_trace')
_INLINE_TAKES_SRC = _takes(_inline_jaxpr, 'src')
_JaxprTrace = _probe('jax._src.interpreters.partial_eval:DynamicJaxprTrace')


def _inlined(closed, args):
    """``closed``'s outputs on ``args`` as equations of the jit trace whose
    tracers ``args`` all are, with exactly the avals ``closed`` was traced
    for (which is what makes skipping abstract evaluation sound); None
    otherwise, and under dynamic shapes (as in jax.jit): then evaluate it."""
    if _inline_jaxpr is None or not args or getattr(jax.config, 'jax_dynamic_shapes', False):
        return None
    trace = _find_top_trace(args)
    if type(trace) is not _JaxprTrace:
        return None
    owner = trace if _STACKLESS else trace.main
    jaxpr, consts = closed.jaxpr, closed.consts
    for arg, var in zip(args, jaxpr.invars):
        if not (isinstance(arg, jax.core.Tracer) and _tracer_trace_id(arg) is owner
                and arg.aval == var.aval):
            return None
    if _INLINE_TAKES_SRC:
        return _inline_jaxpr(trace, _siu.current(), jaxpr, consts, *args)
    return _inline_jaxpr(trace, jaxpr, consts, *args)


# ``wrap_init`` warns without ``debug_info=`` (0.5.1 ..).  ``arg_names=None`` keeps
# state inputs clear of jax_enable_checks' arity check; 0.5, 0.6 need names.
_ARG_NAMES_MAY_BE_NONE = _probe(   # 0.7 ..
    'jax._src.linear_util:DebugInfo.assert_arg_names') is not None


def _trace_to_jaxpr(flat_fun: Callable, in_avals: Sequence, fun: Callable, name: str):
    """Traces ``flat_fun(*leaves)``; returns ``(jaxpr, out_avals, consts)``
    (``trace_to_jaxpr_dynamic`` returns a 4-tuple up to 0.6, a 3-tuple from 0.7)."""
    if _make_debug_info is None:
        wrapped = _lu.wrap_init(flat_fun)
    else:
        names = None if _ARG_NAMES_MAY_BE_NONE else tuple(f'arg{i}' for i in range(len(in_avals)))
        dbg = _make_debug_info(name, fun, (), {})._replace(arg_names=names)
        wrapped = _lu.wrap_init(flat_fun, debug_info=dbg)
    return _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))[:3]


def _axis_env(axis_env, feature: str = 'axis_env'):
    """Context binding named axes ``[(name, size), ...]`` while tracing."""
    if axis_env and _extend_axis_env is None:
        raise NotImplementedError(f'{feature} needs jax._src.core.extend_axis_env_nd, which '
                                  f'JAX {jax.__version__} lacks')
    return _extend_axis_env(list(axis_env)) if axis_env else contextlib.nullcontext()


# Mutable references and the discharge into a pure jaxpr: jax._src.state, all releases.
_ref_aval = _probe('jax._src.state.types:AbstractRef')
_ref_get = _probe('jax._src.state.primitives:ref_get')   # ref_get(ref, ()): all of it
_ref_set = _probe('jax._src.state.primitives:ref_set')
_discharge_state = _probe('jax._src.state.discharge:discharge_state')
_HAS_REFS = None not in (_ref_aval, _ref_get, _ref_set, _discharge_state)
_DISCHARGE_TAKES_CLOSED = _takes(_discharge_state, 'closed_jaxpr')   # 0.10 ..
_NO_REFS = f'that needs mutable references (jax._src.state), which JAX {jax.__version__} lacks'


# Whole-Ref reads and writes.  ``ref_get`` / ``ref_set`` normalise and flatten
# indexers, ``bind`` finds the trace, and the trace redoes the primitive's
# abstract evaluation (uncached for get and swap up to 0.9): half of what a
# State's read and write cost in a scan body.  Inside a jaxpr trace the
# equation is emitted straight (``DynamicJaxprTrace.emit_eqn``, 0.7.2 ..) with
# the params ``ref_get(ref, ())`` binds, no transforms, and the out aval and
# effects of the primitive's own abstract evaluation, cached per avals as JAX
# caches it from 0.10.  What the trace's ``process_primitive`` would add does
# not apply: get and swap have no staging, folding or forwarding rule, are
# not "high" on arrays, and take no constants (a Ref is a tracer, and a value
# that is none is bound).  Elsewhere (before 0.7.2; under grad or vmap) they
# are bound.
_get_p = _probe('jax._src.state.primitives:get_p')      # all releases
_swap_p = _probe('jax._src.state.primitives:swap_p')    # all releases
_emit_eqn = _probe('jax._src.interpreters.partial_eval:DynamicJaxprTrace.emit_eqn')  # 0.7.2 ..
_STAGE_REFS = (_STACKLESS and _takes(_emit_eqn, 'effects')
               and None not in (_get_p, _swap_p, _JaxprTrace))
_WHOLE_REF = {'tree': jax.tree_util.tree_structure(())}


@functools.lru_cache(maxsize=1024)
def _ref_type(aval):
    """The aval of a Ref holding ``aval`` (built once: its constructor copies ``aval``)."""
    return _ref_aval(aval)


@functools.lru_cache(maxsize=1024)
def _whole_ref_type(primitive, *avals):
    """``(out_aval, effects)`` of ``primitive`` on whole Refs, for ``avals``."""
    return primitive.abstract_eval(*avals, **_WHOLE_REF)


def _staged(primitive, args):
    """``primitive`` (get or swap) on ``args`` as an equation of the current
    jaxpr trace, or None where that is not the current trace."""
    trace = _src_core.trace_ctx.trace
    if type(trace) is not _JaxprTrace:
        return None
    src = _siu.current()
    tracers = [trace.to_jaxpr_tracer(a, src) for a in args]
    out_aval, effects = _whole_ref_type(primitive, *(t.aval for t in tracers))
    return trace.emit_eqn(tracers, [out_aval], primitive, _WHOLE_REF, effects, src)[0]


def _read_ref(ref):
    """The whole value of ``ref``, traced."""
    if _STAGE_REFS:
        out = _staged(_get_p, (ref,))
        if out is not None:
            return out
    return _ref_get(ref, ())


def _write_ref(ref, value) -> None:
    """Sets the whole of ``ref`` to ``value``, traced.  (A value that is no
    tracer, e.g. a Python scalar, is bound: bind makes it a JAX array.)"""
    if _STAGE_REFS and isinstance(value, Tracer) and _staged(_swap_p, (ref, value)) is not None:
        return
    _ref_set(ref, (), value)


def _discharge(closed):
    """``closed`` made pure: Ref inputs become values, final values extra outputs."""
    if _DISCHARGE_TAKES_CLOSED:
        return _discharge_state(closed)
    return _close(*_discharge_state(closed.jaxpr, closed.consts))


# Rewriting a Ref program by hand (``_fast_discharge``) needs fresh variables,
# the Ref effects to drop, and the params layout of the equations it rewrites;
# an equation laid out otherwise goes to ``_discharge``.  Jit lists per-output
# 'out_shardings' and 'out_layouts' (all releases); scan's layout is below.
try:
    _VAR_TAKES_SUFFIX = _takes(Var.__init__, 'suffix')   # Var(suffix, aval) up to 0.6
except (TypeError, ValueError):                         # (no Python signature)
    _VAR_TAKES_SUFFIX = False
_RefEffect = _probe('jax._src.state.types:RefEffect')           # all releases
_ReadEffect = _probe('jax._src.state.types:ReadEffect')         # all releases
_InputEffect = _probe('jax._src.effects:JaxprInputEffect')      # all releases
_JIT_LAYOUT = ('jaxpr', 'in_shardings', 'out_shardings', 'in_layouts', 'out_layouts')
_WHILE_LAYOUT = ('cond_jaxpr', 'body_jaxpr', 'cond_nconsts', 'body_nconsts')   # all releases


def _effect_input(effect, jaxpr):
    """The input of ``jaxpr`` (a constvar or invar) that a Ref effect of
    ``jaxpr`` is on: numbered by ``input_index``, constvars first, up to 0.9;
    the variable itself (``input``) from 0.10."""
    inputs = [*jaxpr.constvars, *jaxpr.invars]
    at = getattr(effect, 'input_index', None)
    if at is not None:
        return inputs[at]
    return getattr(effect, 'input', None)


def _fresh_var(aval):
    return Var('', aval) if _VAR_TAKES_SUFFIX else Var(aval)


# A scan's inputs are its consts, carries and scanned-over arrays: counted in
# 'num_consts' / 'num_carry' up to 0.10 (with a per-input 'linear' up to 0.9),
# and from 0.11 grouped in 'ft_in' = (consts, carry, xs) and 'ft_out' =
# (carry, ys), jax._src.flattree trees.
_ft_pack = _probe('jax._src.flattree:pack')     # 0.11 ..
_ft_nones = _probe('jax._src.flattree:nones')   # 0.11 ..


def _scan_counts(params):
    """``(num_consts, num_carry)`` of a scan, or None if laid out otherwise."""
    if 'num_consts' in params and 'num_carry' in params:
        return params['num_consts'], params['num_carry']
    if _ft_pack is None or _ft_nones is None or 'ft_out' not in params:
        return None
    try:
        consts, carry, _ = params['ft_in'].unpack()
        plain = consts == _ft_nones(len(consts)) and carry == _ft_nones(len(carry))
    except Exception:   # (a layout this code does not know)
        return None
    return (len(consts), len(carry)) if plain else None


def _scan_params(params, num_consts: int, num_carry: int) -> dict:
    """A scan's ``params`` for new counts of consts and carries (the inputs
    and outputs moving between the two sit at the front of the carries)."""
    if 'num_consts' in params:
        return dict(params, num_consts=num_consts, num_carry=num_carry)
    _, _, xs = params['ft_in'].unpack()
    _, ys = params['ft_out'].unpack()
    return dict(params, ft_in=_ft_pack((_ft_nones(num_consts), _ft_nones(num_carry), xs)),
                ft_out=_ft_pack((_ft_nones(num_carry), ys)))


def _unnamed(debug_info):
    """``debug_info`` for a body whose inputs and outputs were rewritten:
    without argument names and result paths (0.7 ..), none (.. 0.4.38, which
    asserts their counts), or as it was (0.5, 0.6 need names, assert nothing)."""
    if _make_debug_info is None or debug_info is None:
        return None
    if not _ARG_NAMES_MAY_BE_NONE:
        return debug_info
    return debug_info._replace(arg_names=None, result_paths=None)


# Primitive names and params keys the jaxpr passes rely on.  Call primitives:
# 'pjit' became 'jit' in 0.7, 'closed_call' / 'core_call' became 'eval_jaxpr'
# in 0.11; the body is the 'jaxpr' or 'call_jaxpr' param.  Collectives name
# their axes in 'axes' (or 'axis_name'); psum_invariant exists from 0.6.
_CALL_PRIMITIVES = frozenset({'pjit', 'jit', 'closed_call', 'core_call', 'eval_jaxpr'})
_CALL_BODY_PARAMS = ('jaxpr', 'call_jaxpr')
_COLLECTIVES = frozenset({'psum', 'pmax', 'pmin', 'psum_invariant'})
_AXIS_INDEX = 'axis_index'
_NO_FOLD_PARTS = ('random_', 'callback')   # random_bits, ..., io_callback, ...
_NO_FOLD_PRIMITIVES = frozenset({
    'threefry2x32', 'rng_bit_generator', 'rng_uniform', 'cond', 'while', 'scan',
    'custom_jvp_call', 'custom_vjp_call', 'custom_vjp_call_jaxpr', 'checkpoint', 'remat',
    'shard_map', 'xla_pmap', 'xla_call', 'custom_lin', _AXIS_INDEX, 'pure_callback',
    'io_callback', 'debug_callback', 'debug_print', 'device_put'})


def _collective_axes(eqn):
    return eqn.params.get('axes', eqn.params.get('axis_name', ()))


# =============================================================================
# 2. Errors and small helpers
#
# The two errors users catch, and the helpers every later section leans on:
# where user code called from, what a value's signature is (the unit of every
# cache key), and whether a value spans several devices.
# =============================================================================

Tracer, ShapedArray = jax.core.Tracer, jax.core.ShapedArray


class TraceContextError(RuntimeError):
    """A traced value would escape the JAX trace it belongs to.

    Raised when a value is written into a :class:`State` where no enclosing
    stateful trace can thread it out (for example inside a plain ``jax.jit``,
    or per-lane inside a ``jax.vmap`` nested in a stateful function), and when
    a State that kept a tracer from a finished trace is read.

    Example
    -------
    >>> s = State(jnp.zeros(()))
    >>> @jax.jit
    ... def f(x):
    ...     s.value = x          # raises TraceContextError
    ...     return x
    """


class BatchAxisError(ValueError):
    """A state's batch axis is inconsistent with what the mapping declared.

    Raised by :class:`StatefulMapping` with
    ``unexpected_out_state_mapping='raise'`` when a state that came in
    unbatched is written with a batched value.
    """


_JAX_DIR = os.path.dirname(jax.__file__)


def _outside(skip_jax: bool):
    """``(frame, level)`` of the first caller outside this module (and JAX)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename == __file__ or (
            skip_jax and frame.f_code.co_filename.startswith(_JAX_DIR))):
        frame, level = frame.f_back, level + 1
    return frame, level


def _user_site():
    """``(filename, lineno, function)`` of the first caller outside this module."""
    frame = _outside(skip_jax=False)[0]
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _user_stacklevel() -> int:
    """``warnings.warn`` stacklevel pointing past this module and JAX."""
    return _outside(skip_jax=True)[1] - 1


def _who(sf) -> str:
    """``StatefulFunction('f')``: how errors name a function."""
    return f'{type(sf).__name__}({sf.name!r})'


def _is_int(x) -> bool:
    """An integer that is not a bool (nor a tracer)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _label(state) -> str:
    return state._name or type(state).__name__


def _format_site(site) -> str:
    if site is None:
        return 'an unknown place'
    filename, lineno, func = site
    return f'{filename}:{lineno} (in {func})'


def _leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree)


def _aval_of(x):
    """Abstract value of an array-like leaf (tracers keep their own aval)."""
    aval = getattr(x, 'aval', None)
    if aval is not None:
        return aval
    return _typeof(x)


def _leaf_sig(x) -> tuple:
    """``(shape, dtype, weak_type)`` of a leaf: the unit of every cache key.

    Plain tuples compare equal for a concrete array and a tracer of the same
    type, which ``ShapedArray`` objects (carrying sharding) may not.
    """
    aval = getattr(x, 'aval', None)
    if aval is None:
        aval = _typeof(x)
    return aval.shape, aval.dtype, aval.weak_type


def _value_sig(value) -> tuple:
    """Structure and leaf signatures of a state value (what makes a trace stale)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, tuple(map(_leaf_sig, leaves))


def _stale_sig(value, sig, weak_type: bool = False):
    """``value``'s signature where it is not ``sig`` (None where it is).  A
    weak type counts only with ``weak_type``, for reusing a trace: it changes
    promotion there, as an argument's does."""
    try:
        got = _value_sig(value)
    except TypeError:
        return 'not a pytree of arrays'
    if got == sig or (not weak_type and got[0] == sig[0] and all(
            a[:2] == b[:2] for a, b in zip(got[1], sig[1]))):
        return None
    return got


def _contains_tracer(tree) -> bool:
    return any(isinstance(x, Tracer) for x in _leaves(tree))


# Bumped when a State is given, outside any trace, a value spanning several
# devices or in place of one.  A compiled call keeps each written state's
# layout through a constraint traced into its dispatcher, and jax.jit retraces
# on new shapes but not on new shardings; so a changed layout must reach the
# dispatcher's static key (see ``_layout_token``).  Unsharded code never
# bumps it, and the warm path only compares it.
_layout_epoch = 0


def _spans_devices(value) -> bool:
    return any(_multi_device(leaf) for leaf in _leaves(value))


def _multi_device(leaf):
    """``leaf``'s sharding if it spans several devices, else ``None``."""
    sharding = getattr(leaf, 'sharding', None)
    if sharding is None or isinstance(leaf, Tracer) or len(sharding.device_set) < 2:
        return None
    return sharding


# =============================================================================
# 3. States and the state trace stack
#
# A State is a mutable box for a pytree of arrays whose ``value`` property
# knows whether a stateful trace is running in this thread: outside one it is
# a plain attribute; inside, reads and writes go to the trace's frame (see
# section 6).  StateTraceStack, the public recorder, is such a frame.
# =============================================================================

# How many StateTraceStacks are open in all threads: while none is, a call
# skips reading the thread-local stack (the warm path's most common case).
_frames_open = 0
_frames_lock = threading.Lock()


def _open_frames(delta: int) -> None:
    global _frames_open
    with _frames_lock:
        _frames_open += delta


class _Context(threading.local):
    """Per-thread tracing context."""

    def __init__(self):
        self.frames: list = []         # active StateTraceStacks, outermost first
        self.catchers: list = []       # active catch_new_states collectors
        self.check_tree = False        # inside check_state_value_tree(True)
        self.ntraces: int = 0          # user-function traces run by this thread
        self.trace_error = None        # what the last failed trace raised


_ctx = _Context()
_MISSING = object()


def _innermost_overlay(frames):
    """The innermost stack with an overlay (see StateTraceStack), or None."""
    for frame in reversed(frames):
        if frame._overlays:
            return frame
    return None


class _StateSurface:
    """The part of State's API that follows brainstate 0.2.1's names and
    semantics, so that code written for brainstate runs unchanged."""
    __slots__ = ()

    @property
    def stack_level(self) -> int:
        """Depth of the state trace stack when this State was created."""
        return self._stack_level

    @stack_level.setter
    def stack_level(self, level: int):
        self._stack_level = level

    def increase_stack_level(self) -> None:
        """Adds one to :attr:`stack_level`."""
        self._stack_level += 1

    def decrease_stack_level(self) -> None:
        """Subtracts one from :attr:`stack_level` (not below 0)."""
        self._stack_level = max(self._stack_level - 1, 0)

    def raise_error_with_source_info(self, error: BaseException):
        """Raises ``error`` with this State's creation site attached.

        Example
        -------
        >>> s = State(1.0, name='w')
        >>> s.raise_error_with_source_info(ValueError('bad'))  # doctest: +SKIP
        ValueError: bad [State 'w' created at ...]
        """
        message = f'{error} [{self._describe()}]'
        try:
            new = type(error)(message)
        except Exception:  # exceptions with unusual constructors
            new = RuntimeError(message)
        raise new from error

    def to_state_ref(self) -> 'TreefyState':
        """A pytree snapshot of this State: its class, value and metadata."""
        return TreefyState(type(self), self._value, _name=self._name, **self._metadata)

    def update_from_ref(self, state_ref: 'TreefyState') -> None:
        """Takes value and metadata from a :meth:`to_state_ref` snapshot; the
        value is assigned as a write."""
        metadata = state_ref.get_metadata()
        self._name = metadata.pop('_name', self._name)
        self._metadata.update(metadata)
        self.value = state_ref.value

    def value_call(self, func: Callable):
        """``jax.tree.map(func, self.value)``."""
        return jax.tree_util.tree_map(func, self.value)

    def check_if_deleted(self) -> None:
        """Raises ``ValueError`` if a leaf's buffer was deleted (e.g. donated)."""
        if self._broken is not None:
            self._raise_broken()
        for leaf in _leaves(self._value):
            if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.is_deleted():
                raise ValueError(
                    f'{self._describe()} holds an array whose buffer was deleted (donated to '
                    'a computation or deleted by hand); assign it a new value')

    def numel(self) -> int:
        """Total number of elements over all leaves of the value."""
        return int(sum(math.prod(np.shape(x)) for x in _leaves(self._value)))


class State(_StateSurface):
    """A mutable container for a pytree of arrays.

    Reading ``state.value`` inside a function traced by
    :class:`StatefulFunction` records a read and returns the traced value;
    assigning records a write.  Outside any trace ``value`` is a plain
    attribute.

    Parameters
    ----------
    value
        Initial value: an array or any pytree of arrays.
    name : str, optional
        Used in reprs, jaxpr labels and error messages.
    **metadata
        Free-form metadata; ``tag`` is used by string filters.

    Example
    -------
    >>> s = State(jnp.ones(3), name='w', tag='param')
    >>> s.value = s.value * 2
    >>> s.value
    Array([2., 2., 2.], dtype=float32)
    """

    __slots__ = ('_value', '_name', '_metadata', '_source', '_stack_level',
                 '_owner', '_creation_trace', '_broken', '__weakref__', '__dict__')

    def __init__(self, value, name: str | None = None, **metadata):
        if isinstance(value, State):
            raise ValueError(
                f'cannot create {type(self).__name__}(name={name!r}) holding another '
                f'State ({value!r}); pass its value instead: State(other.value)')
        self._name = name
        self._metadata = metadata
        self._source = _user_site()
        self._check_value(value)
        self._value = value
        self._broken = None
        frames = _ctx.frames
        self._stack_level = len(frames)
        self._owner = None
        self._creation_trace = _current_trace_id()
        owner = _innermost_overlay(frames)
        if owner is not None:
            self._owner = owner
            owner._owned.append(self)
        for catcher in _ctx.catchers:
            catcher.append(self)

    # -- value ---------------------------------------------------------------
    @property
    def value(self):
        """The current value; reads and writes are recorded while tracing."""
        frames = _ctx.frames
        if frames:
            return _traced_read(self, frames)
        if self._broken is not None:
            self._raise_broken()
        if _under_jax_trace():
            # Read by a plain JAX trace: a jaxpr JAX may cache holds this value.
            _BAKED_STATES.add(self)
        return self._value

    @value.setter
    def value(self, v):
        self._assign(v, written=True)

    def restore_value(self, v) -> None:
        """Sets the value without recording a write (a read is recorded)."""
        self._assign(v, written=False)

    def _assign(self, v, written: bool) -> None:
        global _layout_epoch
        self._check_assignment(v)
        frames = _ctx.frames
        if frames:
            _traced_write(self, v, frames, written=written)
            return
        _check_tracers_may_enter(self, v, ())
        if _spans_devices(v) or _spans_devices(self._value):
            _layout_epoch += 1
        self._value = v
        self._broken = None

    def _check_value(self, v) -> None:
        """Hook for subclasses that restrict what a value may be."""

    def _check_assignment(self, v) -> None:
        # (A tracer, the common value while tracing, is a leaf: no tree walk.)
        if not isinstance(v, Tracer) and (
                isinstance(v, State) or any(isinstance(x, State) for x in _leaves(v))):
            raise ValueError(
                f'cannot assign a State as the value of {self._describe()}; '
                'assign its value instead: target.value = other.value')
        self._check_value(v)
        if _ctx.check_tree:
            old = jax.tree_util.tree_structure(self._current_for_compare())
            new = jax.tree_util.tree_structure(v)
            if old != new:
                raise ValueError(
                    f'the pytree structure of {self._describe()} would change from '
                    f'{old} to {new} inside check_state_value_tree(); assign a value '
                    'with the same structure or leave the check_state_value_tree() block')

    def _current_for_compare(self):
        frame = _innermost_overlay(_ctx.frames)
        v = _MISSING if frame is None else frame._values.get(id(self), _MISSING)
        if type(v) is _RefCell:
            return jax.tree_util.tree_unflatten(v.treedef, v.avals)
        return self._value if v is _MISSING else v

    def _raise_broken(self):
        # ``_broken``: (exception type, message, short description) when the
        # State holds nothing readable (a finished trace's tracer, a buffer
        # deleted by a failed donating call) until it is assigned again.
        kind, message, _ = self._broken
        raise kind(message)

    # -- metadata --------------------------------------------------------------
    @property
    def name(self) -> str | None:
        """The name given at creation (or ``None``)."""
        return self._name

    @name.setter
    def name(self, name):
        self._name = name

    @property
    def tag(self):
        """The ``tag`` metadata entry (``None`` when absent)."""
        return self._metadata.get('tag')

    @tag.setter
    def tag(self, tag):
        self._metadata['tag'] = tag

    @property
    def metadata(self) -> dict:
        """Free-form metadata given at creation."""
        return self._metadata

    @property
    def source_info(self) -> str:
        """Where this State was created, as ``file:line (in function)``."""
        return _format_site(self._source)

    def _describe(self) -> str:
        label = f"{type(self).__name__} {self._name!r}" if self._name else type(self).__name__
        return f'{label} created at {self.source_info}'

    # -- copies ------------------------------------------------------------------
    def copy(self) -> 'State':
        """A new State of the same class with the same value and metadata."""
        return self.replace(self._value)

    def replace(self, value=_MISSING, **metadata) -> 'State':
        """A new State of the same class holding ``value`` (default: the
        current one), with this State's metadata updated by ``metadata``.
        Given a State of the same class as ``value``, returns that State
        (``replace``-d with ``metadata`` if any).
        """
        if isinstance(value, State):
            if type(value) is not type(self):
                raise ValueError(
                    f'{self._describe()}.replace() got a {type(value).__name__} as the value; '
                    f'pass a {type(self).__name__} or a plain value')
            return value.replace(**metadata) if metadata else value
        return _new_state(type(self), self._value if value is _MISSING else value,
                          self._name, {**self._metadata, **metadata})

    # -- identity --------------------------------------------------------------
    def __hash__(self):
        return hash(id(self))

    def __eq__(self, other):
        return self is other

    def __repr__(self):
        if self._broken is not None:
            shown = f'<{self._broken[2]}>'
        else:
            shown = repr(self._value)
        name = f'name={self._name!r}, ' if self._name else ''
        if '\n' in shown:
            shown = '\n  ' + shown.replace('\n', '\n  ')
        return f'{type(self).__name__}({name}value={shown})'


def _new_state(cls, value, name, metadata) -> State:
    """A ``cls`` built without its constructor, whose parameters vary by class."""
    new = cls.__new__(cls)
    State.__init__(new, value, name, **metadata)
    return new


class TreefyState:
    """A State's class, value and metadata as a pytree whose only child is
    the value (what :meth:`State.to_state_ref` returns).

    Example
    -------
    >>> ref = State(jnp.ones(2), name='w').to_state_ref()
    >>> jax.tree_util.tree_leaves(ref)
    [Array([1., 1.], dtype=float32)]
    >>> ref.to_state().name
    'w'
    """

    def __init__(self, type: type, value, **metadata):
        self.type = type
        self.value = value
        vars(self).update(metadata)

    @property
    def name(self) -> str | None:
        """The State's name."""
        return vars(self).get('_name')

    def get_metadata(self) -> dict:
        """Everything but ``type`` and ``value``."""
        return {k: v for k, v in vars(self).items() if k not in ('type', 'value')}

    def replace(self, value) -> 'TreefyState':
        """The same snapshot holding ``value``."""
        return TreefyState(self.type, value, **self.get_metadata())

    def copy(self) -> 'TreefyState':
        """A shallow copy."""
        return self.replace(self.value)

    def to_state(self) -> State:
        """A new State of the recorded class, value and metadata."""
        metadata = self.get_metadata()
        return _new_state(self.type, self.value, metadata.pop('_name', None), metadata)


jax.tree_util.register_pytree_with_keys(
    TreefyState,
    lambda r: (((jax.tree_util.GetAttrKey('value'), r.value),),
               (r.type, tuple(r.get_metadata().items()))),
    lambda aux, children: TreefyState(aux[0], children[0], **dict(aux[1])),
    flatten_func=lambda r: ((r.value,), (r.type, tuple(r.get_metadata().items()))))


class ShortTermState(State):
    """A State whose value is transient (e.g. the last input or spike)."""
    __slots__ = ()


class LongTermState(State):
    """A State whose value persists across steps (e.g. running statistics)."""
    __slots__ = ()


class ParamState(LongTermState):
    """A trainable parameter."""
    __slots__ = ()


class BatchState(LongTermState):
    """A State holding per-batch statistics."""
    __slots__ = ()


class HiddenState(ShortTermState):
    """A recurrent hidden state; its value must be a single array.

    Example
    -------
    >>> h = HiddenState(jnp.zeros(4))
    """
    __slots__ = ()

    def _check_value(self, v):
        if not (isinstance(v, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))
                or isinstance(v, Tracer)):
            raise ValueError(
                f'{self._describe()} holds a single array, got {type(v).__name__}; '
                'use State for pytree values')


def _is_typed_key(x) -> bool:
    return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_raw_key(x) -> bool:
    return (hasattr(x, 'dtype') and not _is_typed_key(x) and x.dtype == np.uint32
            and len(np.shape(x)) >= 1 and np.shape(x)[-1] == 2)


def _make_key(seed_or_key, owner: str):
    if seed_or_key is None:
        return jax.random.PRNGKey(_pyrandom.randrange(2 ** 31))
    if isinstance(seed_or_key, (bool, np.bool_)):
        raise ValueError(f'{owner}: a seed must be an int or a PRNG key, got a bool')
    if isinstance(seed_or_key, (int, np.integer)):
        return jax.random.PRNGKey(int(seed_or_key))
    if isinstance(seed_or_key, Tracer) or isinstance(seed_or_key, (jax.Array, np.ndarray)):
        if _is_typed_key(seed_or_key) or _is_raw_key(seed_or_key):
            return seed_or_key
        if np.size(seed_or_key) == 1 and jnp.issubdtype(seed_or_key.dtype, jnp.integer):
            return jax.random.PRNGKey(jnp.reshape(seed_or_key, ()))   # an integer array seed
    kind = type(seed_or_key).__name__
    if hasattr(seed_or_key, 'shape'):
        kind += f' {getattr(seed_or_key, "dtype", "")}{list(np.shape(seed_or_key))}'
    raise ValueError(
        f'{owner}: expected an int seed, None, a raw uint32[2] key or a typed key '
        f'(jax.random.key), got {kind}')


class RandomState(State):
    """A State holding a PRNG key, split and advanced as you draw.

    Parameters
    ----------
    seed_or_key : int, key array or None
        An int seeds ``jax.random.PRNGKey(seed)`` (raw ``uint32[2]``); a raw
        or typed key is held as given; ``None`` draws a fresh random seed.

    Example
    -------
    >>> rng = RandomState(0)
    >>> noise = jax.random.normal(rng.split_key(), (3,))
    """
    __slots__ = ()
    _backup = None   # the key saved by backup_key()

    def __init__(self, seed_or_key=None, name: str | None = None, **metadata):
        owner = f'{type(self).__name__}(name={name!r}) created at {_format_site(_user_site())}'
        super().__init__(_make_key(seed_or_key, owner), name, **metadata)

    def _check_value(self, v):
        if not (_is_raw_key(v) or _is_typed_key(v)):
            raise ValueError(
                f'{self._describe()} holds a PRNG key (raw uint32[..., 2] or typed), got '
                f'{type(v).__name__} {getattr(v, "dtype", "")}{list(np.shape(v))}')

    def seed(self, seed_or_key=None) -> None:
        """Resets the key: ``PRNGKey(int)``, a given key, or a fresh random one."""
        self.value = _make_key(seed_or_key, f'{self._describe()}.seed')

    def set_key(self, key) -> None:
        """Assigns ``key`` as the new key."""
        self.value = key

    def split_key(self, n: int | None = None, backup: bool = False):
        """Advances the state; returns one new key, or ``n`` keys stacked.
        With ``backup=True`` the advanced key is also saved (:meth:`backup_key`).

        Example
        -------
        >>> rng = RandomState(0)
        >>> keys = rng.split_key(4)    # 4 independent keys
        """
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f'{self._describe()}: split_key(n) needs an int n >= 1, '
                             f'got {n!r}; call split_key() for a single key')
        # Eagerly, the read and the write are one step for other threads (a
        # trace takes no lock: the call that runs it holds the State's).
        with contextlib.nullcontext() if _ctx.frames else _state_lock(self):
            keys = jax.random.split(self.value, 2 if n is None else int(n) + 1)
            self.value = keys[0]
            if backup:
                self.backup_key()
        return keys[1] if n is None else keys[1:]

    def self_assign_multi_keys(self, n: int, backup: bool = True) -> None:
        """Replaces the key by ``n`` keys split from it (a ``[n, ...]`` key
        array, e.g. one per lane).  With ``backup`` the state first advances
        and saves its key, so :meth:`restore_key` returns to a single key."""
        if backup:
            keys = jax.random.split(self.value, n + 1)
            self.value = keys[0]
            self.backup_key()
            self.value = keys[1:]
        else:
            self.value = jax.random.split(self.value, n)

    def backup_key(self) -> None:
        """Remembers the current key so that :meth:`restore_key` can return to it."""
        if self._backup is not None:
            raise ValueError(f'{self._describe()}: backup_key() called twice without '
                             'restore_key(); restore the saved key first')
        self._backup = self.value

    def restore_key(self) -> None:
        """Sets the key saved by :meth:`backup_key` (and forgets the backup)."""
        if self._backup is None:
            raise ValueError(f'{self._describe()}: restore_key() without a backup_key(); '
                             'call backup_key() first')
        self.value, self._backup = self._backup, None

    def clone(self) -> 'RandomState':
        """A new, independent RandomState seeded from a key split off this one."""
        return type(self)(self.split_key(), self._name, **dict(self._metadata))


class _StackSurface:
    """The part of StateTraceStack's API that follows brainstate 0.2.1's
    names and return types (``been_writen`` is its spelling too)."""
    __slots__ = ()

    def read_its_value(self, state: State) -> None:
        """Records a read of ``state``."""
        self._touch(state, state._value, False)

    def write_its_value(self, state: State) -> None:
        """Records a write of ``state``."""
        self._touch(state, state._value, True)

    def get_state_values(self, separate: bool = False, replace: bool = False) -> tuple:
        """Current values of the recorded states.

        With ``separate=True`` returns ``(write_values, read_values)``; with
        ``replace=True`` as well, excluded entries are ``None`` so that
        positions line up with :attr:`states`.
        """
        if not separate:
            return tuple(s.value for s in self.states)
        return (self.get_write_state_values(replace), self.get_read_state_values(replace))

    def get_read_state_values(self, replace_writen: bool = False) -> tuple:
        """Values of :meth:`get_read_states`."""
        return tuple(None if s is None else s.value for s in self.get_read_states(replace_writen))

    def get_write_state_values(self, replace_read: bool = False) -> tuple:
        """Values of :meth:`get_write_states`."""
        return tuple(None if s is None else s.value for s in self.get_write_states(replace_read))

    def recovery_original_values(self) -> None:
        """Gives every recorded state back the value it had when first touched."""
        for state, original in zip(self.states, self._originals):
            if (original is not None and type(original) is not _RefCell
                    and not _contains_tracer(original)):
                state.restore_value(original)

    def assign_state_vals(self, state_vals: Sequence) -> None:
        """Assigns ``state_vals`` (one per state): written states by ``value``,
        the others by ``restore_value``."""
        if len(state_vals) != len(self.states):
            raise ValueError(f'State length mismatch: expected {len(self.states)} values, '
                             f'got {len(state_vals)}')
        self._assign_each(state_vals, state_vals)

    def assign_state_vals_v2(self, read_state_vals: Sequence, write_state_vals: Sequence) -> None:
        """Like :meth:`assign_state_vals` with separate read and write lists
        (each as long as :attr:`states`, as from ``get_state_values(True, True)``)."""
        if not (len(read_state_vals) == len(write_state_vals) == len(self.states)):
            raise ValueError(
                f'State length mismatch: expected {len(self.states)} read and write values, '
                f'got {len(read_state_vals)} and {len(write_state_vals)}')
        self._assign_each(read_state_vals, write_state_vals)

    def _assign_each(self, read_vals, write_vals) -> None:
        for state, rv, wv, written in zip(self.states, read_vals, write_vals, self.been_writen):
            if written:
                state.value = wv
            else:
                state.restore_value(rv)

    def state_subset(self, state_type: type) -> list:
        """The recorded states that are instances of ``state_type``."""
        return [s for s in self.states if isinstance(s, state_type)]


class StateTraceStack(_StackSurface):
    """Records which States a piece of code touches, in first-touch order.

    Used as a context manager; stacks nest LIFO and are thread-local.  A read
    inside a nested stack is also recorded by every enclosing stack.  Query
    results are tuples (``state_subset`` gives a list), as in brainstate.

    Parameters
    ----------
    new_arg : callable, optional
        ``new_arg(state) -> value``: called on a state's first touch; its
        result is what the code inside the stack sees for that state.  A stack
        with ``new_arg`` keeps the values assigned to states inside it (an
        overlay) instead of writing them into the States.
    name : str, optional
        A label for error messages.

    Example
    -------
    >>> a, b = State(1.0), State(2.0)
    >>> with StateTraceStack() as st:
    ...     b.value = a.value + 1
    >>> st.states == [a, b], st.been_writen, st.original_state_values
    (True, [False, True], (1.0, 2.0))
    """

    _jax_trace = None   # a recorder belongs to no JAX trace (see _TraceFrame)

    def __init__(self, new_arg: Callable | None = None, name: str | None = None):
        self.name = name
        self.states: list = []
        self.been_writen: list = []
        self._index: dict = {}
        self._originals: list = []
        # With new_arg the stack *overlays*: what code inside sees and writes
        # lives in this overlay (state id -> value), and the States created
        # inside are its own until it closes.
        self._overlays = False
        self._values: dict = {}
        self._owned: list = []
        if new_arg is not None:
            if not callable(new_arg):
                raise TypeError(
                    f'StateTraceStack(new_arg=None, name=None) got new_arg={new_arg!r}, which '
                    f'is not callable; to name the stack pass name={new_arg!r} by keyword')
            self.set_new_arg(new_arg)

    def set_new_arg(self, new_arg: Callable) -> None:
        """Makes this stack lift states through ``new_arg(state)`` (see class doc)."""
        self._new_arg = new_arg
        self._overlays = True

    def _lift(self, state, current):
        # ``current`` is the enclosing stack's view of the state, which a
        # _TraceFrame needs; new_arg sees only the State.
        return self._new_arg(state)

    def new_arg(self, state: State) -> None:
        """Lifts ``state`` through the ``new_arg`` function now (no-op without one)."""
        if self._overlays:
            self._values[id(state)] = self._lift(state, state._value)

    @property
    def original_state_values(self) -> tuple:
        """Each recorded state's value when this stack first saw it."""
        return tuple(self._originals)

    # -- recording -----------------------------------------------------------
    def _touch(self, state, current, write: bool):
        index = self._index.get(id(state))
        if index is None:
            self._index[id(state)] = len(self.states)
            self.states.append(state)
            self.been_writen.append(write)
            self._originals.append(current)
            if self._overlays:
                current = self._values[id(state)] = self._lift(state, current)
            return current
        if write:
            self.been_writen[index] = True
        return self._values[id(state)] if self._overlays else current

    # -- context -------------------------------------------------------------
    def __enter__(self):
        _open_frames(+1)
        _ctx.frames.append(self)
        return self

    def __exit__(self, *exc):
        frames = _ctx.frames
        if self in frames:
            _open_frames(-1)
        if not frames or frames[-1] is not self:
            if self in frames:
                frames.remove(self)
            raise RuntimeError(
                f'StateTraceStack {self.name!r} exited out of order: trace stacks must '
                'be exited in the reverse order they were entered (use nested `with`)')
        frames.pop()
        self._close()
        return False

    def _close(self):
        """Ends an overlay: drop its tracers, flag States that kept one."""
        for state in self._owned:
            state._owner = None
            if _contains_tracer(state._value):
                state._broken = (
                    TraceContextError,
                    f'{state._describe()} was created inside a traced function and still '
                    'holds a tracer from that finished trace; return its value from the '
                    'function (or create the State outside it) instead of reading it afterwards',
                    'tracer from a finished trace')
        self._owned = []
        self._values = {}

    # -- queries -------------------------------------------------------------
    def get_read_states(self, replace_writen: bool = False) -> tuple:
        """States only read (written ones are ``None`` with ``replace_writen``)."""
        if replace_writen:
            return tuple(None if w else s for s, w in zip(self.states, self.been_writen))
        return tuple(s for s, w in zip(self.states, self.been_writen) if not w)

    def get_write_states(self, replace_read: bool = False) -> tuple:
        """States written (read-only ones are ``None`` with ``replace_read``)."""
        if replace_read:
            return tuple(s if w else None for s, w in zip(self.states, self.been_writen))
        return tuple(s for s, w in zip(self.states, self.been_writen) if w)

    def merge(self, *others: 'StateTraceStack') -> 'StateTraceStack':
        """Adds the states of ``others`` to this stack (writes OR-ed); returns ``self``."""
        for stack in others:
            for state, written, original in zip(stack.states, stack.been_writen,
                                                stack._originals):
                self._touch(state, original, written)
        return self

    def _record_copy(self) -> 'StateTraceStack':
        """A plain stack recording what this one recorded (``merge`` into a
        fresh stack, without a touch per state)."""
        copy = StateTraceStack(name=self.name)
        copy.states, copy.been_writen = list(self.states), list(self.been_writen)
        copy._index, copy._originals = dict(self._index), list(self._originals)
        return copy

    def __add__(self, other: 'StateTraceStack') -> 'StateTraceStack':
        """A new stack holding the states of both."""
        return StateTraceStack().merge(self, other)

    def __repr__(self):
        rows = ', '.join(f'{_label(s)}:{"w" if w else "r"}'
                         for s, w in zip(self.states, self.been_writen))
        return f'StateTraceStack(name={self.name!r}, states=[{rows}])'


class _StateCatcher:
    """The States created inside a :func:`catch_new_states` block, in
    creation order (iterable, indexable, ``in`` by identity)."""

    def __init__(self, state_tag, state_to_exclude):
        self.state_tag = state_tag
        self.state_to_exclude = to_predicate(state_to_exclude)
        self.state_ids: set = set()
        self.states: list = []

    def append(self, state: State) -> None:
        """Adds ``state`` (tagging it) unless excluded or already caught."""
        if id(state) in self.state_ids or self.state_to_exclude((), state):
            return
        if self.state_tag is not None:
            state.tag = self.state_tag
        self.state_ids.add(id(state))
        self.states.append(state)

    def remove(self, state: State) -> None:
        """Forgets ``state`` if caught."""
        if id(state) in self.state_ids:
            self.state_ids.discard(id(state))
            self.states.remove(state)

    def clear(self) -> None:
        """Forgets every caught State."""
        self.state_ids.clear()
        self.states.clear()

    def get_states(self) -> list:
        """The caught States."""
        return self.states

    def get_state_values(self) -> list:
        """Their current values."""
        return [s.value for s in self.states]

    def get_by_tag(self, tag: str) -> list:
        """The caught States whose tag is ``tag``."""
        return [s for s in self.states if s.tag == tag]

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index):
        return self.states[index]

    def __contains__(self, state) -> bool:
        return id(state) in self.state_ids


@contextlib.contextmanager
def catch_new_states(state_tag: str | None = None, state_to_exclude=None):
    """Collects the States created inside the block, except those matching
    the filter ``state_to_exclude``, and tags them with ``state_tag``.

    Example
    -------
    >>> with catch_new_states('layer1') as new:
    ...     w = State(jnp.ones(2))
    >>> new.get_states() == [w], w.tag
    (True, 'layer1')
    """
    catcher = _StateCatcher(state_tag, state_to_exclude)
    _ctx.catchers.append(catcher)
    try:
        yield catcher
    finally:
        _ctx.catchers.remove(catcher)


@contextlib.contextmanager
def check_state_value_tree(val: bool = True):
    """Inside this block, assigning a value whose pytree structure differs
    from a State's current one raises ``ValueError`` (``val=False`` turns the
    check off inside an enclosing block).

    Example
    -------
    >>> s = State({'a': 1.0})
    >>> with check_state_value_tree():
    ...     s.value = {'a': 2.0}      # fine; {'b': 2.0} would raise
    """
    outer, _ctx.check_tree = _ctx.check_tree, bool(val)
    try:
        yield
    finally:
        _ctx.check_tree = outer


# =============================================================================
# 4. State filters
#
# ``state_in_axes`` / ``state_out_axes`` pick states with filters: a State
# subclass, a tag string, a predicate ``f(path, state)``, ``True``/``...``,
# ``False``/``None``, a tuple/list (any of), or the combinators below.
# =============================================================================

class _Filter:
    """Base of the filter combinators: a predicate ``f(path, state) -> bool``."""

    def __call__(self, path, x) -> bool:
        raise NotImplementedError

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self), tuple(sorted(vars(self).items(), key=str))))


class OfType(_Filter):
    """Matches instances of ``type``.

    Example
    -------
    >>> OfType(ParamState)((), ParamState(1.0))
    True
    """

    def __init__(self, type: type):
        self.type = type

    def __call__(self, path, x):
        return isinstance(x, self.type)

    def __repr__(self):
        return f'OfType({self.type.__name__})'


class WithTag(_Filter):
    """Matches states whose ``tag`` is ``tag`` (what a string filter means).

    Example
    -------
    >>> WithTag('hidden')((), State(0.0, tag='hidden'))
    True
    """

    def __init__(self, tag: str):
        self.tag = tag

    def __call__(self, path, x):
        return getattr(x, 'tag', None) == self.tag

    def __repr__(self):
        return f'WithTag({self.tag!r})'


class _Combination(_Filter):
    """Combines the predicates of several filters with ``_reduce`` (any / all)."""
    _reduce = staticmethod(any)

    def __init__(self, *filters):
        self.predicates = tuple(to_predicate(f) for f in filters)

    def __call__(self, path, x):
        return self._reduce(p(path, x) for p in self.predicates)

    def __repr__(self):
        return f'{type(self).__name__}({", ".join(map(repr, self.predicates))})'


class Any(_Combination):
    """Matches when any of ``filters`` matches.

    Example
    -------
    >>> Any(ParamState, 'hidden')((), State(0.0, tag='hidden'))
    True
    """
    _reduce = staticmethod(any)


class All(_Combination):
    """Matches when all of ``filters`` match.

    Example
    -------
    >>> weight = ParamState(0.0, tag='w')
    >>> All(ParamState, 'w')((), weight), All(ParamState, 'b')((), weight)
    (True, False)
    """
    _reduce = staticmethod(all)


class Not(_Filter):
    """Matches when ``filter`` does not.

    Example
    -------
    >>> Not(ParamState)((), State(0.0))
    True
    """

    def __init__(self, filter):
        self.predicate = to_predicate(filter)

    def __call__(self, path, x):
        return not self.predicate(path, x)

    def __repr__(self):
        return f'Not({self.predicate!r})'


class _Constant(_Filter):
    """A filter that gives the same answer for every state."""
    answer = True

    def __call__(self, path, x):
        return self.answer

    def __repr__(self):
        return f'{type(self).__name__}()'


class Everything(_Constant):
    """Matches every state.

    Example
    -------
    >>> Everything()((), State(0.0))
    True
    """
    answer = True


class Nothing(_Constant):
    """Matches no state.

    Example
    -------
    >>> [Nothing()((), s) for s in (State(0.0), ParamState(1.0))]
    [False, False]
    """
    answer = False


def to_predicate(the_filter) -> Callable:
    """Turns any filter into a predicate ``f(path, state) -> bool``.

    Example
    -------
    >>> pred = to_predicate((ParamState, 'hidden'))
    >>> pred((), ParamState(1.0)), pred((), State(1.0))
    (True, False)
    """
    if isinstance(the_filter, _Filter):
        return the_filter
    if the_filter is Everything or the_filter is Nothing:
        return the_filter()
    if the_filter is True or the_filter is Ellipsis:
        return Everything()
    if the_filter is False or the_filter is None:
        return Nothing()
    if isinstance(the_filter, type):
        return OfType(the_filter)
    if isinstance(the_filter, str):
        return WithTag(the_filter)
    if isinstance(the_filter, (tuple, list)):
        return Any(*the_filter)
    if callable(the_filter):
        return the_filter
    raise TypeError(
        f'unsupported state filter {the_filter!r} of type {type(the_filter).__name__}; use a State '
        'subclass, a tag string, a predicate f(path, state), True/..., False/None, a '
        'tuple/list of filters, or OfType/Any/All/Not/Everything/Nothing')


# =============================================================================
# 5. Cache and argument keys
#
# A stateful function keeps one trace per call signature.  Static arguments
# count by value, which needs hashable forms of lists and dicts
# (``make_hashable``); the traces live in a bounded, thread-safe LRU cache
# that keeps brainstate's statistics; and a call's arguments are split into
# static and dynamic ones and turned into a key.
# =============================================================================

class hashabledict(dict):
    """A read-only ``dict`` hashable by its sorted items (used for cache keys).

    Example
    -------
    >>> k = hashabledict(static_args=(), dyn_args=())
    >>> {k: 1}[hashabledict(dyn_args=(), static_args=())]
    1
    """

    def __hash__(self):
        h = self.__dict__.get('_hash')
        if h is None:
            h = hash(tuple(sorted(self.items(), key=lambda kv: repr(kv[0]))))
            self.__dict__['_hash'] = h
        return h

    def _readonly(self, *args, **kwargs):
        raise TypeError('hashabledict is immutable (it is used as a cache key)')

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _readonly

    def __repr__(self):
        return f'hashabledict({dict.__repr__(self)})'


def make_hashable(obj):
    """A hashable stand-in for ``obj`` (lists/tuples → tuples, dicts → sorted
    item tuples, sets → frozensets, other pytrees → ``(treedef, leaves)``).

    Example
    -------
    >>> make_hashable({'b': [1, 2], 'a': 0})
    (('a', 0), ('b', (1, 2)))
    """
    if isinstance(obj, (list, tuple)):
        return tuple(make_hashable(x) for x in obj)
    if isinstance(obj, dict):
        return tuple(sorted(((k, make_hashable(v)) for k, v in obj.items()),
                            key=lambda kv: repr(kv[0]) if not isinstance(kv[0], str) else kv[0]))
    if isinstance(obj, (set, frozenset)):
        return frozenset(make_hashable(x) for x in obj)
    if isinstance(obj, (State, str, bytes, int, float, complex, type(None))):
        return obj
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    if treedef.num_nodes > 1 or treedef.num_leaves != 1 or leaves[0] is not obj:
        return treedef, tuple(make_hashable(x) for x in leaves)
    return obj


class BoundedCache:
    """A thread-safe LRU cache holding at most ``maxsize`` entries.

    Example
    -------
    >>> c = BoundedCache(maxsize=2)
    >>> c.set('a', 1); c.set('b', 2); c.get('a'); c.set('c', 3)
    1
    >>> sorted(c.keys())           # 'b' was least recently used
    ['a', 'c']
    """

    def __init__(self, maxsize: int = 128):
        if not _is_int(maxsize) or maxsize < 1:
            raise ValueError(f'BoundedCache(maxsize) needs an int >= 1, got {maxsize!r}')
        self.maxsize = int(maxsize)
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.RLock()
        self._reset_counters()

    def _reset_counters(self):
        # ``next()`` on an itertools.count is one atomic C call, so lock-free
        # callers (the compiled fast path) can count hits cheaply.
        self._hits = itertools.count()
        self._misses = itertools.count()
        self._retracted = itertools.count()   # hits taken back (see _record_retraced)

    @staticmethod
    def _read(counter) -> int:
        # ``repr`` is count's only public view of its position (``__reduce__``
        # is deprecated in Python 3.12 and gone in 3.14).
        return int(repr(counter)[len('count('):-1])

    def _record(self, hit: bool) -> None:
        next(self._hits if hit else self._misses)

    def _record_retraced(self) -> None:
        """Turns a hit the warm path counts, before it knows, into a miss."""
        next(self._retracted)
        next(self._misses)

    def _peek(self, key, default=None):
        """Lookup without statistics (refreshes recency)."""
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def get(self, key, default=None, raise_on_miss: bool = False, error_context: str = 'item'):
        """The value for ``key`` (counted as a hit or miss)."""
        with self._lock:
            value = self._peek(key, _MISSING)
            self._record(value is not _MISSING)
            if value is not _MISSING:
                return value
            if raise_on_miss:
                available = '\n'.join(f'  - {k!r}' for k in self._data) or '  none'
                raise ValueError(
                    f'{error_context} not compiled for the requested cache key.\n'
                    f'Requested key: {key!r}\nAvailable keys:\n{available}\n'
                    'Call make_jaxpr() with these arguments first.')
            return default

    def set(self, key, value) -> None:
        """Adds a new entry (``ValueError`` if ``key`` is already present)."""
        with self._lock:
            if key in self._data:
                raise ValueError(f'Cache key already exists: {key!r}; use replace()')
            self._store(key, value)

    def _store(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def replace(self, key, value) -> None:
        """Replaces an existing entry (``KeyError`` if ``key`` is missing)."""
        with self._lock:
            if key not in self._data:
                raise KeyError(f'Cache key does not exist: {key!r}; use set()')
            self._data[key] = value
            self._data.move_to_end(key)

    def pop(self, key, default=None):
        """Removes and returns the entry for ``key``."""
        with self._lock:
            return self._data.pop(key, default)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def keys(self) -> list:
        """The stored keys, least recently used first."""
        with self._lock:
            return list(self._data.keys())

    def clear(self) -> None:
        """Removes every entry and resets the statistics."""
        with self._lock:
            self._data.clear()
            self._reset_counters()

    def get_stats(self) -> dict:
        """``{size, maxsize, hits, misses, hit_rate}``; ``hit_rate`` in percent."""
        with self._lock:
            misses = self._read(self._misses)
            hits = max(0, self._read(self._hits) - self._read(self._retracted))
            total = hits + misses
            return {'size': len(self._data), 'maxsize': self.maxsize, 'hits': hits,
                    'misses': misses, 'hit_rate': 100.0 * hits / total if total else 0.0}


_BoundedCache = BoundedCache   # brainstate 0.2.1's name for it


# -- Argument keys ------------------------------------------------------------
# A call's cache key holds the static arguments by value and the dynamic ones
# by pytree structure and ``(shape, dtype, weak_type)`` per leaf.  These
# functions take the StatefulFunction (``sf``) only for its static_argnums,
# static_argnames and name.

def _normalize_argnums(argnums, what: str) -> tuple:
    if argnums is None:
        return ()
    if _is_int(argnums):
        argnums = (argnums,)
    if not isinstance(argnums, Iterable) or not all(_is_int(a) for a in argnums):
        raise TypeError(f'{what} must be an int or a sequence of ints, got {argnums!r}')
    return tuple(operator.index(a) for a in argnums)


def _normalize_argnames(argnames, what: str) -> tuple:
    if argnames is None:
        return ()
    if isinstance(argnames, str):
        return (argnames,)
    argnames = tuple(argnames)
    if not all(isinstance(a, str) for a in argnames):
        raise TypeError(f'{what} must be a str or a sequence of str, got {argnames!r}')
    return argnames


def _static_positions(sf, nargs: int) -> tuple:
    out = []
    for i in sf.static_argnums:
        j = i + nargs if i < 0 else i
        if not 0 <= j < nargs:
            raise ValueError(
                f'{_who(sf)}: static_argnums contains {i}, but the call passed only {nargs} '
                'positional argument(s); pass that argument positionally or fix static_argnums')
        out.append(j)
    return tuple(sorted(set(out)))


def _split_args(sf, args, kwargs) -> tuple:
    """``(static_args, dyn_args, static_kwargs, dyn_kwargs)``; static_args are
    ``(position, value)`` pairs."""
    statics = _static_positions(sf, len(args)) if sf.static_argnums else ()
    static_args = tuple((i, args[i]) for i in statics)
    dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)
    names = sf.static_argnames
    static_kwargs = {k: v for k, v in kwargs.items() if k in names}
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    return static_args, dyn_args, static_kwargs, dyn_kwargs


def _hash_static(sf, where: str, value):
    """``(key, by_value)``: the static ``value`` as a key, and whether only its
    ``make_hashable`` form hashes (jax.jit then needs it wrapped)."""
    _reject_states(value, f'{_who(sf)}: static {where}')
    h = make_hashable(value)
    try:
        hash(h)
    except TypeError:
        raise TypeError(
            f'{_who(sf)}: static {where} of type {type(value).__name__} is not hashable; '
            'static arguments are cache keys. Pass a hashable value (e.g. a tuple) or make '
            'the argument dynamic') from None
    try:
        hash(value)
    except TypeError:
        return h, True
    return h, False


def _call_key(sf, args, kwargs):
    """``(key, flat_dynamic_leaves, split, by_value)`` for a call, with clear
    errors; ``by_value``: some static argument hashes only by value."""
    split = static_args, dyn_args, static_kwargs, dyn_kwargs = _split_args(sf, args, kwargs)
    by_value = False
    hashed = []
    for where, value in ([(f'positional argument {i}', v) for i, v in static_args]
                         + [(f'keyword argument {k!r}', v) for k, v in static_kwargs.items()]):
        h, wrapped = _hash_static(sf, where, value)
        hashed.append(h)
        by_value |= wrapped
    leaves_a, tree_a = jax.tree_util.tree_flatten(dyn_args)
    leaves_k, tree_k = jax.tree_util.tree_flatten(dyn_kwargs)
    try:
        sigs = tuple(map(_leaf_sig, leaves_a + leaves_k))
    except TypeError:
        _explain_bad_leaves(sf, dyn_args, dyn_kwargs)
        raise
    n = len(static_args)
    key = hashabledict(
        static_args=tuple(zip([i for i, _ in static_args], hashed[:n])),
        dyn_args=(tree_a, sigs[:len(leaves_a)]),
        static_kwargs=tuple(sorted(zip(static_kwargs, hashed[n:]))),
        dyn_kwargs=(tree_k, sigs[len(leaves_a):]),
    )
    return key, leaves_a + leaves_k, split, by_value


def _explain_bad_leaves(sf, dyn_args, dyn_kwargs):
    for what, tree in (('argument ', dyn_args), ('keyword argument ', dyn_kwargs)):
        _reject_states(tree, f'{_who(sf)}: {what}')
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            try:
                _leaf_sig(leaf)
            except TypeError:
                raise TypeError(
                    f'{_who(sf)}: dynamic {what}{jax.tree_util.keystr(path)} has type '
                    f'{type(leaf).__name__}, which is not a JAX type; mark it static '
                    '(static_argnums / static_argnames) or pass an array') from None


def _rebuilder(split):
    """``rebuild(flat) -> (args, kwargs)`` putting static values back in place."""
    static_args, dyn_args, static_kwargs, dyn_kwargs = split
    tree = jax.tree_util.tree_structure((dyn_args, dyn_kwargs))
    statics = dict(static_args)
    nargs = len(dyn_args) + len(statics)

    def rebuild(flat):
        dyn, kw = jax.tree_util.tree_unflatten(tree, flat)
        it = iter(dyn)
        args = [statics[i] if i in statics else next(it) for i in range(nargs)]
        return args, {**kw, **static_kwargs}
    return rebuild


class _StaticArg:
    """Carries a static argument through jax.jit, hashed by ``make_hashable``."""
    __slots__ = ('value', '_key')

    def __init__(self, value):
        self.value = value
        self._key = make_hashable(value)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _StaticArg) and self._key == other._key


def _wrap_statics(sf, args, kwargs):
    """The call's static arguments as _StaticArgs (jax.jit hashes those)."""
    static_args, _, static_kwargs, _ = _split_args(sf, args, kwargs)
    args = list(args)
    for i, value in static_args:
        args[i] = _StaticArg(value)
    kwargs = {k: _StaticArg(v) if k in static_kwargs else v for k, v in kwargs.items()}
    return tuple(args), kwargs


# =============================================================================
# 6. The tracing core
#
# ``_trace_stateful`` turns ``fun(*args, **kwargs)`` into a ClosedJaxpr whose
# inputs are the flat dynamic arguments followed by every touched State (in
# first-touch order) and whose outputs are the flat results followed by the
# returned states.  The trace runs inside a ``_TraceFrame``: the ``value``
# property of a State sends reads and writes there, so tracers never enter a
# State object, and a failed trace has nothing to restore.  A State becomes a
# new jaxpr input the first time the function touches it, on the trace
# captured when tracing starts, so a first read deep inside ``lax.scan``,
# ``grad`` or an inner ``jit`` is an input rather than a baked-in constant.
# A State *written* inside such a nested transformation is lifted as Refs
# instead (``_RefCell``), and the finished jaxpr is discharged into a pure
# one, which threads the write out as a scan carry, a cond output and so on.
#
# Staying clear of JAX's trace caches.  JAX caches the traces of lax
# control-flow bodies and of jitted functions, keyed on the Python function
# and ``config.trace_context()``.  A module-level scan body that reads a State
# could then be reused by a later trace with a finished trace's tracer baked
# in, or after a write with the old value; and a State read by a plain JAX
# trace (``_BAKED_STATES``) may sit inside any cached jaxpr.  The axis
# environment is part of that context on every release, so binding a unique
# size-1 axis (``_TraceEpoch``; no jaxpr refers to it) makes those caches
# miss.  This *isolation* also makes jax.numpy's own jitted helpers retrace
# (about a millisecond per trace), so a trace is isolated only once it is
# known to need it (``_TraceHints``), and renews its epoch when a write
# follows a nested read of the same State.
# =============================================================================

class _Traced:
    """Everything one trace produced; immutable once built."""
    __slots__ = ('closed_jaxpr', 'out_tree', 'out_avals', 'states', 'returned',
                 'state_tree', 'full_tree', 'state_sigs', 'trace_stack', 'cacheable', 'n_out')

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    def runner(self) -> Callable:
        """``run(flat_args, state_values) -> (out, returned_state_values)``.

        Outside any stateful trace (in a dispatcher's jit trace) the jaxpr is
        inlined rather than evaluated; inside one it is evaluated, so that the
        enclosing jaxpr is what eval_jaxpr gives."""
        closed, n_out = self.closed_jaxpr, self.n_out
        run, out_tree, state_tree = _jaxpr_as_fun(closed), self.out_tree, self.state_tree

        def apply(flat_args, state_values):
            args = [*flat_args, *_leaves(state_values)]
            outs = None if _ctx.frames else _inlined(closed, args)
            if outs is None:
                outs = run(*args)
            return (jax.tree_util.tree_unflatten(out_tree, outs[:n_out]),
                    jax.tree_util.tree_unflatten(state_tree, outs[n_out:]))
        return apply

    def out_shapes(self):
        """``(out_shapes, state_part)`` as ``jax.ShapeDtypeStruct`` pytrees."""
        return self.full_tree.unflatten([jax.ShapeDtypeStruct(a.shape, a.dtype)
                                         for a in self.out_avals])


_gc_lock = threading.Lock()
_gc_pauses = [0, False]   # active pauses, whether gc was enabled at the first


@contextlib.contextmanager
def _gc_paused():
    """Pauses the cyclic garbage collector while tracing.

    A trace allocates many small, long-lived objects; generation-2 collections
    rescanning them made tracing grow faster than linearly in the number of
    states.  Nested and concurrent traces share one pause.
    """
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


def _reject_states(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, State):
            where = f'{what}{jax.tree_util.keystr(path)} is' if path else what.rstrip()
            raise ValueError(
                f'{where} a State ({leaf._describe()}); '
                'return or pass its value instead (state.value)')


# -- The trace frame ----------------------------------------------------------
class _TraceFrame(StateTraceStack):
    """The frame of one stateful trace: a StateTraceStack with an overlay,
    whose first touch of a State adds jaxpr inputs for it.  It is built
    inside the traced function, where its JAX trace is the current one.

    ``pending`` collects the States written inside nested transformations
    that were not lifted as Refs, ``speculated`` the ones lifted as Refs
    only because they were first touched there (see _TraceHints)."""

    def __init__(self, name: str, hints: '_TraceHints', lift_aval, pending: set,
                 speculated: list, isolated: bool):
        super().__init__(name=name)
        self._overlays = True
        self._builder = _find_top_trace(())     # the trace new inputs go to
        self._jax_trace = _current_trace_id()   # a nested transformation's differs
        self._hints, self._lift_aval = hints, lift_aval
        self._pending = pending if _HAS_REFS else None
        self._speculated = speculated
        self._nested_reads = set()              # ids of states read in nested traces
        self._epoch = _TraceEpoch()
        self._isolated = isolated
        self.cells: list = []                   # the _RefCells, for the discharge
        self.final_reads: list = []             # (output position, Ref number): finish()
        self.placeholders: dict = {}            # aval -> its placeholder input: _final()
        self._ref_numbers: dict = {}            # id(cell) -> its first Ref's number
        self._n_refs = 0
        self.lifted: list = []                  # (state, treedef, avals) per lift
        self.result: dict = {}                  # what finish() found out

    def _lift(self, state, current):
        """New jaxpr inputs for ``state`` (a _RefCell of Refs where it is, or
        may be, written inside a nested transformation)."""
        if type(current) is _RefCell:    # an enclosing trace holds it as Refs
            treedef, avals = current.treedef, list(current.avals)
        else:
            leaves, treedef = jax.tree_util.tree_flatten(current)
            avals = []
            for leaf in leaves:
                try:
                    avals.append(_aval_of(leaf))
                except TypeError:
                    raise TypeError(f'{state._describe()} holds a leaf of type '
                                    f'{type(leaf).__name__}, which is not a JAX array '
                                    'type') from None
        self.lifted.append((state, treedef, avals))
        if self._lift_aval is not None:
            avals = [self._lift_aval(state, a) for a in avals]
        known = bool(self._hints.ref_states) and state in self._hints.ref_states
        if known or (self._hints.speculate and _current_trace_id() is not self._jax_trace):
            if not known:
                self._speculated.append(state)
            cell = _RefCell(state, [_new_arg(self._builder, _ref_type(a)) for a in avals],
                            treedef, avals)
            self._ref_numbers[id(cell)] = self._n_refs
            self._n_refs += len(avals)
            self.cells.append(cell)
            return cell
        return jax.tree_util.tree_unflatten(treedef, [_new_arg(self._builder, a) for a in avals])

    def finish(self, out, return_only_write: bool) -> list:
        """The flat jaxpr outputs for the function's result ``out``: its leaves,
        then the values of the returned states (the written ones, or all)."""
        _reject_states(out, 'the function returned ')
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        returned = [i for i, w in enumerate(self.been_writen) if w or not return_only_write]
        values, state_leaves = [], []
        for i in returned:
            value = self._values[id(self.states[i])]
            if type(value) is _RefCell:
                leaves = self._final(value, len(out_leaves) + len(state_leaves))
                value = jax.tree_util.tree_unflatten(value.treedef, leaves)
            else:
                leaves = _leaves(value)
            values.append(value)
            state_leaves.extend(leaves)
        state_tree = jax.tree_util.tree_structure(values)
        # (out, one entry per state, None where not returned): the structure
        # brainstate's jaxpr_call and out_treedef expose.
        part = [None] * len(self.states)
        for i, v in zip(returned, values):
            part[i] = v
        self.result = dict(out_tree=out_tree, n_out=len(out_leaves), returned=tuple(returned),
                           state_tree=state_tree,
                           full_tree=jax.tree_util.tree_structure((out, tuple(part))))
        return out_leaves + state_leaves

    def _final(self, cell: '_RefCell', position: int) -> list:
        """The output leaves, from ``position`` on, of a state held as Refs:
        placeholders, one new last jaxpr input per aval, that the discharge
        replaces by the Refs' final values (``final_reads`` pairs each output
        position with its Ref's number among the Ref inputs).  Reading the
        Refs instead would cost a traced read each."""
        first = self._ref_numbers[id(cell)]
        self.final_reads.extend((position + j, first + j) for j in range(len(cell.refs)))
        for aval in cell.avals:
            if aval not in self.placeholders:
                self.placeholders[aval] = _new_arg(self._builder, aval)
        return [self.placeholders[aval] for aval in cell.avals]

    def traced(self, closed, out_avals) -> _Traced:
        sigs = {id(state): (treedef, tuple((a.shape, a.dtype, a.weak_type) for a in avals))
                for state, treedef, avals in self.lifted}
        return _Traced(closed_jaxpr=closed, out_avals=list(out_avals),
                       states=tuple(self.states),
                       state_sigs=tuple(sigs[id(s)] for s in self.states),
                       trace_stack=self._record_copy(),
                       cacheable=not any(isinstance(c, Tracer) for c in closed.consts),
                       **self.result)

    def __enter__(self):
        if self._isolated:
            self._epoch.renew()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._epoch.close()

    def _close(self):
        super()._close()
        self._originals = [None] * len(self.states)   # a finished trace's tracers


# -- Traced reads and writes --------------------------------------------------
def _owner_start(state, frames) -> int:
    """Index of the first frame for which ``state`` is not a local State."""
    owner = state._owner
    if owner is not None:
        for i in range(len(frames) - 1, -1, -1):
            if frames[i] is owner:
                return i + 1
    return 0


def _traced_read(state, frames):
    top = frames[-1]
    if top._overlays:  # fast path: already lifted by the innermost frame
        v = top._values.get(id(state), _MISSING)
        if v is not _MISSING:
            return _view(state, v, top)
    return _view(state, *_touch_all(state, frames, write=False))


def _touch_all(state, frames, write: bool):
    """Records ``state`` in every frame that sees it; returns the innermost
    overlaying frame's entry for it (a value or a ``_RefCell``) and that frame."""
    start = _owner_start(state, frames)
    if start == 0 and state._broken is not None:
        state._raise_broken()
    current, source = state._value, None
    for frame in frames[start:]:
        current = frame._touch(state, current, write)
        if frame._overlays:
            source = frame
    return current, source


def _view(state, entry, frame):
    """What traced code sees when it reads ``entry``, ``frame``'s view of ``state``."""
    if type(entry) is _RefCell:
        return entry.read()
    if frame is not None and frame._jax_trace is not None and (
            _current_trace_id() is not frame._jax_trace):
        frame._nested_reads.add(id(state))   # a nested transformation closes over it
    return entry


def _traced_write(state, value, frames, written: bool):
    entry, target = _touch_all(state, frames, write=written)
    if type(entry) is _RefCell:
        entry.write(value)
        return
    if target is not None and target._jax_trace is not None:
        if _current_trace_id() is not target._jax_trace:
            if target._pending is not None:
                # Written inside a nested transformation: the value cannot
                # leave it through the overlay.  The trace is redone with the
                # state lifted as Refs (see _trace_stateful).
                target._pending.add(state)
                if not target._isolated:
                    raise _Retrace   # abort, so JAX caches no body without the write
                return
            if not _HAS_REFS:
                raise TraceContextError(
                    f'{state._describe()} is written inside a nested JAX transformation '
                    f'(lax.scan / lax.cond / an inner jax.jit / jax.grad ...); {_NO_REFS}.  '
                    'Return the value from the transformation and assign it outside')
        elif id(state) in target._nested_reads:
            # A body traced before this write closed over the old value; make
            # JAX's trace caches miss so that a later use retraces it.
            target._epoch.renew()
            target._nested_reads.clear()
    allowed = tuple(f._jax_trace for f in frames if f._jax_trace is not None)
    _check_tracers_may_enter(state, value, allowed)
    if target is None:   # only recording stacks (or the creating trace) above
        state._value = value
        state._broken = None
    else:
        target._values[id(state)] = value


def _check_tracers_may_enter(state, value, allowed_traces) -> None:
    """Rejects a tracer that would outlive its trace inside ``state``."""
    for leaf in _leaves(value):
        if isinstance(leaf, Tracer):
            trace = _tracer_trace_id(leaf)
            if trace is state._creation_trace or trace in allowed_traces:
                continue
            if allowed_traces:
                raise TraceContextError(
                    f'{state._describe()} was assigned a traced value inside a JAX '
                    'transformation (lax.scan / lax.cond / an inner jax.jit / jax.grad ...) '
                    'nested in a stateful function, and no enclosing trace can thread it '
                    'out: the State was created inside the stateful function.  Create the '
                    'State outside the function, '
                    'or return the value from the transformation and assign it outside.')
            raise TraceContextError(
                f'{state._describe()} was assigned a JAX tracer while no stateful trace is '
                'active (e.g. inside a plain jax.jit / jax.grad / jax.vmap); the State would '
                'keep a tracer that outlives its transformation.  Wrap the outer function '
                'in StatefulFunction (or StatefulMapping) so state updates are threaded, or '
                'thread the values explicitly with StatefulFunction.jaxpr_call().')


# -- Writes inside nested transformations: Refs and their discharge -----------
class _RefCell:
    """A State that a stateful trace lifted as Refs, one per leaf, because the
    function writes it inside a nested transformation.  Reads and writes bind
    at whatever JAX trace is current, so a scan body sees the value of its
    own iteration and an inner jit's write reaches the code after it."""
    __slots__ = ('state', 'refs', 'treedef', 'avals', 'leaf')

    def __init__(self, state, refs, treedef, avals):
        self.state, self.refs, self.treedef, self.avals = state, refs, treedef, avals
        # A State holding one array, the common case, skips the pytree walks.
        self.leaf = len(refs) == 1 and jax.tree_util.treedef_is_leaf(treedef)

    def read(self):
        if self.leaf:
            return _read_ref(self.refs[0])
        return jax.tree_util.tree_unflatten(self.treedef, [_read_ref(r) for r in self.refs])

    def write(self, value) -> None:
        if self.leaf and isinstance(value, Tracer):
            got, want = value.aval, self.avals[0]
            if got.shape == want.shape and got.dtype == want.dtype:
                self._set(self.refs[0], value)
                return
        leaves, treedef = jax.tree_util.tree_flatten(value)
        got = None
        if treedef == self.treedef:
            try:
                got = [_aval_of(x) for x in leaves]
            except TypeError:
                pass
        if got is None or any(g.shape != a.shape or (g.dtype != a.dtype and not g.weak_type)
                              for g, a in zip(got, self.avals)):
            unflatten = jax.tree_util.tree_unflatten
            expected = unflatten(self.treedef, [a.str_short() for a in self.avals])
            shown = (unflatten(treedef, [g.str_short() for g in got]) if got is not None
                     else f'a value of structure {treedef}')
            raise TraceContextError(
                f'{self.state._describe()} is written inside a nested JAX transformation '
                '(lax.scan / lax.cond / lax.while_loop / an inner jax.jit / jax.grad ...), '
                f'where it must keep its structure, shapes and dtypes {expected}; got {shown}. '
                'Cast or reshape the value before assigning it')
        for ref, leaf, g, a in zip(self.refs, leaves, got, self.avals):
            if g.dtype != a.dtype:   # a weakly typed value (e.g. a Python scalar)
                leaf = jax.lax.convert_element_type(leaf, a.dtype)
            self._set(ref, leaf)

    def _set(self, ref, leaf) -> None:
        try:
            _write_ref(ref, leaf)
        except Exception as err:
            # Under jax.grad the value carries a tangent, which a Ref the
            # gradient does not flow through cannot take: keep the primal.
            try:
                _write_ref(ref, jax.lax.stop_gradient(leaf))
            except Exception:
                raise TraceContextError(
                    f'{self.state._describe()} cannot be written inside this nested '
                    f'JAX transformation ({type(err).__name__}: {err}).  A value that '
                    'varies across jax.vmap lanes cannot go into an unbatched State: map '
                    'the function with StatefulMapping instead, or return the value '
                    'from the transformation and assign it outside') from err


# -- The discharge, by renaming ------------------------------------------------
# JAX's discharge re-traces every equation, abstract evaluation included: as
# much again as tracing the function.  The Refs of a stateful trace are used in
# few ways, all written by _RefCell: read or written whole (get, swap), or
# passed into a scan, a while loop, a cond or an inner jit.  Those are
# discharged here by renaming variables: a read becomes the value last
# written, a loop threads the written Refs as carries, a cond and a jit return
# them as extra outputs.  A Ref used any other way (custom_jvp, JAX's own
# rewriting under grad or vmap) sends the whole jaxpr to JAX's discharge.

class _Unhandled(Exception):
    """A Ref use the renaming discharge leaves to JAX's."""


def _fast_discharge(closed: ClosedJaxpr, final_reads=(), placeholders: int = 0) -> ClosedJaxpr:
    """``closed`` with its Ref inputs made values, without its last
    ``placeholders`` inputs, and each output at position ``p`` of a pair
    ``(p, k)`` in ``final_reads`` the final value of its ``k``-th Ref input."""
    if _RefEffect is None or _InputEffect is None:   # (a JAX without them: its own discharge)
        raise _Unhandled
    jaxpr = closed.jaxpr
    refs = [i for i, v in enumerate(jaxpr.invars) if isinstance(v.aval, _ref_aval)]
    body, written = _discharge_body(jaxpr, refs)
    outvars = list(body.outvars)
    for p, k in final_reads:
        outvars[p] = written.get(refs[k], body.invars[refs[k]])
    cut = len(jaxpr.invars) - placeholders
    return body.close(closed.consts, body.invars[:cut], outvars, like=jaxpr)


class _Body:
    """A jaxpr being discharged: its rewritten inputs, equations and outputs."""
    __slots__ = ('jaxpr', 'invars', 'eqns', 'outvars')

    def __init__(self, jaxpr, invars, eqns, outvars):
        self.jaxpr, self.invars, self.eqns, self.outvars = jaxpr, invars, eqns, outvars

    def close(self, consts, invars, outvars, like=None):
        effects = _pure_effects(set().union(*(e.effects for e in self.eqns)))
        return _rebuild(self.jaxpr, consts, like=like, invars=invars, outvars=outvars,
                        eqns=self.eqns, effects=effects,
                        **({} if like is not None else
                           {'debug_info': _unnamed(self.jaxpr.debug_info)}))


def _discharge_body(jaxpr, refs):
    """Discharges the Ref inputs of ``jaxpr`` at positions ``refs``; returns
    the _Body and ``{position: final value}`` for the Refs it writes."""
    at = set(refs)
    if any(isinstance(v.aval, _ref_aval) for v in jaxpr.constvars) or any(
            isinstance(v.aval, _ref_aval) for i, v in enumerate(jaxpr.invars) if i not in at):
        raise _Unhandled
    env = {jaxpr.invars[i]: None for i in refs}   # None until first used (_entry_value)
    sub, inputs = {}, {}
    eqns = _discharge_eqns(jaxpr.eqns, env, sub, inputs)
    outvars = [_renamed(sub, v) for v in jaxpr.outvars]
    if any(isinstance(v, Var) and isinstance(v.aval, _ref_aval) for v in outvars):
        raise _Unhandled
    invars, written = list(jaxpr.invars), {}
    for i in refs:
        ref = jaxpr.invars[i]
        invars[i] = inputs[ref] if ref in inputs else _fresh_var(ref.aval.inner_aval)
        if env[ref] is not None and env[ref] is not invars[i]:
            written[i] = env[ref]
    return _Body(jaxpr, invars, eqns, outvars), written


def _entry_value(eqn, ref, env, inputs):
    """The variable for ``ref``'s value on entry to the body, at its first use
    (in ``eqn``): the output of ``eqn`` where that is a whole read, so that
    the equations using the read need no renaming; else a fresh one."""
    inner, out = ref.aval.inner_aval, eqn.outvars[0] if eqn.outvars else None
    if not (eqn.primitive.name == 'get' and len(eqn.invars) == 1 and type(out) is Var
            and out.aval == inner):
        out = _fresh_var(inner)
    env[ref] = inputs[ref] = out
    return out


def _renamed(sub, atom):
    return sub.get(atom, atom) if isinstance(atom, Var) else atom


def _discharge_eqns(eqns, env, sub, inputs) -> list:
    """``eqns`` with the Refs in ``env`` (Ref variable -> current value)
    discharged; ``sub`` maps each read's variable to the value it reads."""
    out, rename = [], sub.get
    for eqn in eqns:
        invars, refs, renamed = [], [], False
        for i, v in enumerate(eqn.invars):
            if type(v) is not Literal:
                if v in env:
                    refs.append(i)
                new = rename(v, v)
                renamed |= new is not v
                v = new
            invars.append(v)
        # Every other Ref comes out of some equation (or is an input, which
        # _discharge_body checks): one made by JAX, left to JAX.
        for v in eqn.outvars:
            if isinstance(v.aval, _ref_aval):
                raise _Unhandled
        if not refs:
            out.append(eqn.replace(invars=invars) if renamed else eqn)
            continue
        rule = _DISCHARGE_RULES.get(eqn.primitive.name)
        if rule is None:
            raise _Unhandled
        values = list(invars)
        for i in refs:
            ref = eqn.invars[i]
            value = env[ref]
            values[i] = value if value is not None else _entry_value(eqn, ref, env, inputs)
        finals, new = rule(eqn, values, refs)
        for i, final in finals.items():
            env[eqn.invars[i]] = final
        if new is not None:
            out.append(new)
        elif values[0] is not eqn.outvars[0]:
            # a get, or a swap (whose output is the value before the write)
            sub[eqn.outvars[0]] = values[0]
    return out


def _pure_effects(effects) -> set:
    kept = {e for e in effects if not isinstance(e, _RefEffect)}
    if any(isinstance(e, _InputEffect) for e in kept):
        raise _Unhandled
    return kept


def _same_type(aval, ref_aval) -> bool:
    inner = ref_aval.inner_aval
    return aval.shape == inner.shape and aval.dtype == inner.dtype


def _discharge_get(eqn, values, refs):
    if len(eqn.invars) != 1 or not _same_type(eqn.outvars[0].aval, eqn.invars[0].aval):
        raise _Unhandled   # an indexed or transformed read
    return {}, None


def _discharge_swap(eqn, values, refs):
    if (len(eqn.invars) != 2 or refs != [0]
            or not _same_type(eqn.invars[1].aval, eqn.invars[0].aval)):
        raise _Unhandled
    return {0: values[1]}, None


def _finals(eqn, positions):
    """Fresh outputs of ``eqn`` for the Refs it writes, keyed by input position."""
    return {i: _fresh_var(eqn.invars[i].aval.inner_aval) for i in positions}


def _discharge_scan(eqn, values, refs):
    """Written Refs become leading carries; read-only ones stay consts."""
    params, counts = eqn.params, _scan_counts(eqn.params)
    if counts is None or max(refs) >= counts[0]:
        raise _Unhandled
    n_consts, n_carry = counts
    body, written = _discharge_body(params['jaxpr'].jaxpr, refs)
    moved = sorted(written)
    order = ([i for i in range(n_consts) if i not in written] + moved
             + list(range(n_consts, len(values))))
    closed = body.close(params['jaxpr'].consts, [body.invars[i] for i in order],
                        [written[i] for i in moved] + body.outvars)
    finals = _finals(eqn, moved)
    params = dict(_scan_params(params, n_consts - len(moved), n_carry + len(moved)),
                  jaxpr=closed)
    if 'linear' in params:
        params['linear'] = tuple(params['linear'][i] for i in order)
    return finals, eqn.replace(
        invars=[values[i] for i in order], outvars=[finals[i] for i in moved] + list(eqn.outvars),
        params=params, effects=_pure_effects(eqn.effects))


def _discharge_cond(eqn, values, refs):
    """Each branch returns the final values of the Refs any branch writes."""
    if 0 in refs:
        raise _Unhandled
    positions = [i - 1 for i in refs]
    bodies = [_discharge_body(b.jaxpr, positions) for b in eqn.params['branches']]
    moved = sorted(set().union(*(written for _, written in bodies)))
    branches = tuple(
        body.close(b.consts, body.invars,
                   body.outvars + [written.get(p, body.invars[p]) for p in moved])
        for b, (body, written) in zip(eqn.params['branches'], bodies))
    finals = _finals(eqn, [p + 1 for p in moved])
    return finals, eqn.replace(
        invars=values, outvars=[*eqn.outvars, *(finals[p + 1] for p in moved)],
        params=dict(eqn.params, branches=branches), effects=_pure_effects(eqn.effects))


def _discharge_jit(eqn, values, refs):
    """The jitted body returns the final values of the Refs it writes."""
    params = eqn.params
    if any(k not in params for k in _JIT_LAYOUT):
        raise _Unhandled
    body, written = _discharge_body(params['jaxpr'].jaxpr, refs)
    moved = sorted(written)
    closed = body.close(params['jaxpr'].consts, body.invars,
                        body.outvars + [written[i] for i in moved])
    finals = _finals(eqn, moved)
    params = dict(
        params, jaxpr=closed,
        out_shardings=(*params['out_shardings'], *(params['in_shardings'][i] for i in moved)),
        out_layouts=(*params['out_layouts'], *(params['in_layouts'][i] for i in moved)))
    return finals, eqn.replace(invars=values, outvars=[*eqn.outvars, *(finals[i] for i in moved)],
                               params=params, effects=_pure_effects(eqn.effects))


def _discharge_while(eqn, values, refs):
    """Refs the body writes become leading carries, which the condition reads
    in place of its consts; the others stay consts of both."""
    params = eqn.params
    if any(k not in params for k in _WHILE_LAYOUT):
        raise _Unhandled
    n_cond, n_body = params['cond_nconsts'], params['cond_nconsts'] + params['body_nconsts']
    cond_refs = [i for i in refs if i < n_cond]
    body_refs = [i for i in refs if i >= n_cond]
    if max(refs) >= n_body or any(len({eqn.invars[i] for i in at}) < len(at)
                                  for at in (cond_refs, body_refs)):
        raise _Unhandled   # a Ref as a carry, or passed twice to one jaxpr
    body, written = _discharge_body(params['body_jaxpr'].jaxpr, [i - n_cond for i in body_refs])
    cond, cond_written = _discharge_body(params['cond_jaxpr'].jaxpr, cond_refs)
    if cond_written:
        raise _Unhandled
    moved = [n_cond + p for p in sorted(written)]          # eqn positions of the carried Refs
    carried = {eqn.invars[i]: k for k, i in enumerate(moved)}
    slots = [_fresh_var(eqn.invars[i].aval.inner_aval) for i in moved]
    for i in cond_refs:   # the condition reads a carried Ref from its carry slot
        if eqn.invars[i] in carried:
            slots[carried[eqn.invars[i]]] = cond.invars[i]
    keep_cond = [i for i in range(n_cond) if eqn.invars[i] not in carried]
    keep_body = [i for i in range(n_cond, n_body) if i not in moved]
    carry = list(range(n_body, len(values)))
    cond_jaxpr = cond.close(params['cond_jaxpr'].consts,
                            [cond.invars[i] for i in keep_cond] + slots
                            + cond.invars[n_cond:], cond.outvars)
    body_at = [i - n_cond for i in keep_body + moved] + [i - n_cond for i in carry]
    body_jaxpr = body.close(params['body_jaxpr'].consts, [body.invars[i] for i in body_at],
                            [written[i - n_cond] for i in moved] + body.outvars)
    finals = _finals(eqn, moved)
    params = dict(params, cond_jaxpr=cond_jaxpr, body_jaxpr=body_jaxpr,
                  cond_nconsts=len(keep_cond), body_nconsts=len(keep_body))
    return finals, eqn.replace(
        invars=[values[i] for i in keep_cond + keep_body + moved + carry],
        outvars=[finals[i] for i in moved] + list(eqn.outvars),
        params=params, effects=_pure_effects(eqn.effects))


_DISCHARGE_RULES = {'get': _discharge_get, 'swap': _discharge_swap, 'scan': _discharge_scan,
                    'cond': _discharge_cond, 'pjit': _discharge_jit, 'jit': _discharge_jit,
                    'while': _discharge_while}


class _CannotDischarge(TraceContextError):
    """JAX has no discharge rule for a transformation a Ref went through."""


def _refuses_state_effects(err: BaseException) -> bool:
    """Whether ``err`` is a JAX rule refusing a jaxpr with Ref effects: "State
    effect not supported in vmap-of-cond" (all releases), "... in cond
    partial-eval" (under jax.grad, before 0.7), "Effects not supported in
    partial-eval of `checkpoint`/`remat`: [ReadEffect(0)]" (before 0.8)."""
    text = str(err)
    return isinstance(err, NotImplementedError) and (
        'State effect not supported' in text
        or ('Effects not supported' in text and 'Effect(' in text))


def _explain_ref_refusal(err: BaseException, ref_states) -> None:
    """Raises a TraceContextError naming ``ref_states`` (the States a trace
    lifted as Refs, as it writes or may write them inside nested
    transformations) where ``err`` is JAX refusing such a write; returns
    otherwise."""
    # The last two are JAX's batching and JVP rules for swap (0.6 ..), met
    # where a body is transformed after it was traced (a loop under jax.vmap,
    # a jax.checkpoint under jax.grad) rather than at the write; before 0.7
    # JAX trips over the Ref's zero tangent instead of the latter.
    text = str(err)
    if _refuses_state_effects(err):
        why = (f'goes through one that JAX {jax.__version__} cannot carry it through: "{err}" '
               '(e.g. a lax.cond under jax.vmap; on older releases a lax.cond or '
               'jax.checkpoint under jax.grad).  Return the value from that transformation and '
               'assign it outside, or, under jax.vmap, map the function with StatefulMapping '
               'instead')
    elif 'vmapped value on an unbatched' in text:
        why = ('is given a value that JAX batches across jax.vmap lanes (one that differs per '
               'lane, or any value where JAX batches the whole body, as under jax.jacfwd / '
               'jax.hessian on recent releases), which an unbatched State cannot hold: map the '
               'function with StatefulMapping instead, or return the value from the '
               'transformation and assign it outside')
    elif 'differentiated value on a non-differentiated' in text or 'Zero(Ref{' in text:
        why = ('is given a value that carries a gradient, inside a transformation JAX '
               'differentiates as a whole (such as a jax.checkpoint function under jax.grad).  '
               'Return the value from that transformation and assign it outside')
    else:
        return
    described = ', '.join(sorted(s._describe() for s in ref_states))
    if len(ref_states) > 1:
        described = f'one of {described}'
    raise TraceContextError(
        f'a State written inside a nested transformation ({described}) {why}') from err


def _refused_ref(err: BaseException) -> bool:
    """Whether ``err`` is how JAX refuses a Ref somewhere (rather than an
    error of the traced function): a closure it cannot convert (custom_jvp
    before 0.4.36), an attribute Refs lack (shard_map), a Ref's read effect
    where none may be (custom_jvp under jax_enable_checks, 0.4.38 .. 0.6), a
    rule that refuses Ref effects ("State effect not supported in ...": a
    lax.cond under jax.vmap, all releases, or under jax.grad before 0.7),
    no discharge rule."""
    if isinstance(err, (jax.errors.UnexpectedTracerError, _CannotDischarge)):
        return True
    if isinstance(err, jax.errors.ConcretizationTypeError) or not isinstance(
            err, (AttributeError, TypeError, NotImplementedError)):
        return False   # (a traced value used as a Python one is the function's bug)
    # JAX appends where a tracer came from, which may name _RefCell's methods.
    text = str(err).split('The error occurred while tracing')[0]
    return 'Ref' in text or 'Effect' in text or _refuses_state_effects(err)


def _nested_jaxprs(params) -> list:
    """The jaxprs among the values of an equation's ``params``."""
    found = []
    for value in params.values():
        for item in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found


def _loop_condition_reads_a_write(jaxpr) -> bool:
    """Whether a while loop in ``jaxpr`` (or in a jaxpr inside it) has a
    condition that reads a Ref its body writes.  JAX's own discharge gives
    such a condition the value from before the loop on 0.7 .. 0.12 (the loop
    never ends or ends wrongly) and refuses it before."""
    for eqn in jaxpr.eqns:
        params = eqn.params
        if eqn.primitive.name == 'while' and all(k in params for k in _WHILE_LAYOUT):
            n_cond, n_body = params['cond_nconsts'], params['body_nconsts']
            read = {v for v in eqn.invars[:n_cond] if isinstance(v.aval, _ref_aval)}
            body = params['body_jaxpr'].jaxpr
            consts = dict(zip(body.invars[:n_body], eqn.invars[n_cond:n_cond + n_body]))
            written = {consts.get(_effect_input(e, body)) for e in body.effects
                       if isinstance(e, _RefEffect) and not isinstance(e, _ReadEffect)}
            if read & written:
                return True
        if any(_loop_condition_reads_a_write(sub) for sub in _nested_jaxprs(params)):
            return True
    return False


def _rematerialized_write(jaxpr) -> bool:
    """Whether a function under ``jax.checkpoint`` and differentiation (an
    equation with ``differentiated=True``, in ``jaxpr`` or a jaxpr inside it)
    writes a Ref.  JAX runs such a function once for the primal and again to
    rematerialize it, its writes included, so the State would be written
    twice (0.8 ..; before, JAX refuses the effect)."""
    for eqn in jaxpr.eqns:
        if eqn.params.get('differentiated') is True and any(
                isinstance(e, _RefEffect) and not isinstance(e, _ReadEffect)
                for e in eqn.effects):
            return True
        if any(_rematerialized_write(sub) for sub in _nested_jaxprs(eqn.params)):
            return True
    return False


def _discharge_cells(closed: ClosedJaxpr, cells, final_reads, placeholders: int) -> ClosedJaxpr:
    """Turns a jaxpr with Ref inputs into the pure one with value inputs and
    the same outputs, but for the ``final_reads`` (see :meth:`_TraceFrame._final`):
    the final values of the Refs they name, instead of the last
    ``placeholders`` inputs, which go."""
    try:
        return _fast_discharge(closed, final_reads, placeholders)
    except _Unhandled:
        pass
    described = ', '.join(c.state._describe() for c in cells)
    if _ReadEffect is not None and _loop_condition_reads_a_write(closed.jaxpr):
        raise _CannotDischarge(
            f'a lax.while_loop condition reads a State its body writes, among {described}, '
            f'in a program that JAX {jax.__version__} must discharge itself (it writes a State '
            'inside a transformation other than scan, while_loop, cond or jit, or a Ref went '
            'through jax.grad / jax.vmap), and JAX would give that condition the value from '
            'before the loop.  Compute the condition from the loop carry instead (carry the '
            "State's value or the test)")
    if _ReadEffect is not None and _rematerialized_write(closed.jaxpr):
        raise _CannotDischarge(
            f'a State among {described} is written inside a jax.checkpoint function that is '
            'differentiated (jax.grad / jax.vjp / jax.linearize): JAX runs that function again '
            'to rematerialize it, so the write would happen twice.  Write the State outside '
            'the checkpointed function (return the value from it and assign it after)')
    try:
        pure = _discharge(closed)
    except NotImplementedError as err:
        raise _CannotDischarge(
            f'{described} is written inside a nested transformation that JAX '
            f'{jax.__version__} cannot thread state out of ({err}); return the value from '
            'that transformation and assign it outside') from err
    # JAX's discharge appends each Ref's final value to the outputs, in order.
    n, cut = len(closed.jaxpr.outvars), len(closed.jaxpr.invars) - placeholders
    outvars = list(pure.jaxpr.outvars[:n])
    for p, k in final_reads:
        outvars[p] = pure.jaxpr.outvars[n + k]
    for before, after in zip(closed.jaxpr.outvars, outvars):
        if (before.aval.shape, before.aval.dtype) != (after.aval.shape, after.aval.dtype):
            raise TraceContextError(
                f'a State among {described} changed shape inside a nested transformation '
                f'({before.aval.str_short()} became {after.aval.str_short()}), e.g. by '
                'writing a per-lane value inside jax.vmap; map the function with '
                'StatefulMapping instead')
    return _rebuild(pure.jaxpr, pure.consts, like=closed.jaxpr,
                    invars=pure.jaxpr.invars[:cut], outvars=outvars)


# -- Staying clear of JAX's trace caches --------------------------------------
# States read under a plain JAX trace (outside stateful traces) while alive.
_BAKED_STATES: 'weakref.WeakSet' = weakref.WeakSet()
_EPOCH_AXES = itertools.count()


class _TraceEpoch:
    """The unique dummy axis an isolated trace binds (see the section
    comment).  Renewing it makes JAX retrace, rather than reuse from its
    caches, a body that closed over a State's value before a write."""
    __slots__ = ('_cm',)

    def __init__(self):
        self._cm = None

    def renew(self) -> None:
        self.close()
        cm = _axis_env([(f'stateful_jaxpr.epoch{next(_EPOCH_AXES)}', 1)],
                       'keeping stateful traces clear of JAX\'s trace caches')
        cm.__enter__()
        self._cm = cm

    def close(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)


# -- Tracing, and tracing again -----------------------------------------------
class _TraceHints:
    """What earlier traces of one function taught its later ones.

    A trace is isolated (see the section comment) once the function is known
    to write States inside nested transformations, or JAX handed one of its
    traces a body with a finished trace's tracer inside; any trace is while a
    live State was read by a plain JAX trace.

    A State first touched inside a nested transformation is lifted as Refs
    straight away (*speculatively*): it is usually written there too (a scan
    carry kept in a State), and so the trace needs neither the abort nor the
    isolated retrace.  Where JAX cannot take a Ref (a transformation without
    a discharge rule, e.g. jax.checkpoint before 0.7; a rule refusing Ref
    effects, e.g. lax.cond under jax.vmap), the trace fails inside JAX and is
    redone without speculation, for good, and isolated.
    """
    __slots__ = ('ref_states', 'isolate', 'speculate')

    def __init__(self):
        self.ref_states = weakref.WeakSet()   # States written inside nested transformations
        self.isolate = False                  # trace under a fresh _TraceEpoch
        self.speculate = _HAS_REFS            # lift first touches in nested traces as Refs


class _Retrace(Exception):
    """Redo this trace: it met writes made inside nested transformations."""


_TraceSpec = collections.namedtuple(
    '_TraceSpec', 'name return_only_write axis_env lift_aval trace_with')


def _trace_stateful(fun: Callable, flat_avals: Sequence, rebuild: Callable, *,
                    name: str, return_only_write: bool, axis_env=None,
                    lift_aval: Callable | None = None,
                    trace_with: Callable | None = None,
                    hints: _TraceHints | None = None) -> _Traced:
    """Traces ``fun(*rebuild(flat_leaves))`` into a _Traced.

    ``rebuild(flat)`` returns ``(args, kwargs)``; ``lift_aval(state, aval)``
    may change a state leaf's aval (StatefulMapping lifts batched states at
    their per-lane shape); ``trace_with(flat_fun, avals)`` replaces the
    default tracer (for ``abstracted_axes``).  ``hints``, kept across traces
    by the caller, learns which States to lift as Refs and whether to isolate.
    A trace is redone when it meets a write inside a nested transformation to
    a State not lifted as Refs, or a body JAX cached with a finished trace's
    tracer inside: at most three traces per signature, the extra ones once
    per function.  An error the function raises propagates as is.
    """
    if hints is None:
        hints = _TraceHints()
    spec = _TraceSpec(name, return_only_write, axis_env, lift_aval, trace_with)
    while True:
        pending, speculated = set(), []
        isolated = hints.isolate
        try:
            traced = _trace_once(fun, flat_avals, rebuild, spec, hints, pending, speculated)
        except _Retrace:
            continue   # (the finally clause records what it found)
        except Exception as err:
            if speculated and _refused_ref(err):
                # Trace as before (abort at nested writes), and isolated: JAX
                # may have cached a body it traced with a Ref inside.  (An
                # UnexpectedTracerError isolates the next trace if it recurs.)
                hints.speculate = False
                if not isinstance(err, jax.errors.UnexpectedTracerError):
                    hints.isolate = True
                continue
            if isinstance(err, jax.errors.UnexpectedTracerError) and not isolated:
                hints.isolate = True
                continue
            lifted = {*hints.ref_states, *speculated}
            if lifted:
                _explain_ref_refusal(err, lifted)
            raise
        finally:
            # Also when the function raised: the next trace starts informed.
            if pending:
                hints.ref_states.update(pending)
                hints.isolate = True
        if traced.cacheable or isolated:
            return traced
        # Tracer constants: either the caller's enclosing trace (legitimate)
        # or a body JAX reused from a finished trace.  Isolate and look again.
        hints.isolate = True


def _trace_once(fun, flat_avals, rebuild, spec: _TraceSpec, hints: _TraceHints,
                pending: set, speculated: list) -> _Traced:
    """One attempt of ``_trace_stateful``, in a fresh _TraceFrame."""
    isolated = hints.isolate or len(_BAKED_STATES) > 0
    frames = []

    def flat_fun(*flat):
        frame = _TraceFrame(spec.name, hints, spec.lift_aval, pending, speculated, isolated)
        frames.append(frame)
        with frame:
            args, kwargs = rebuild(list(flat))
            return frame.finish(fun(*args, **kwargs), spec.return_only_write)

    trace = spec.trace_with or functools.partial(_trace_to_jaxpr, fun=fun, name=spec.name)
    _ctx.ntraces += 1
    with _axis_env(spec.axis_env), _gc_paused():
        try:
            jaxpr, out_avals, consts = trace(flat_fun, flat_avals)
        except Exception as err:
            _ctx.trace_error = err    # tells the warm path the function raised it
            raise
        if pending:
            raise _Retrace
        closed = _close(jaxpr, consts)
        del jaxpr, consts
        frame = frames[-1]
        if frame.cells:   # (collectives in the jaxpr need the axis names still bound)
            closed = _discharge_cells(closed, frame.cells, frame.final_reads,
                                      len(frame.placeholders))
            # The Ref jaxpr and the cells' tracers go now, not after the
            # collector resumes: it would scan them once more (~1% of a trace).
            frame.cells = frame.placeholders = None
    return frame.traced(closed, out_avals)


def _abstracted_tracer(abstracted_axes, split):
    """A ``trace_with`` for :func:`_trace_stateful` honouring ``abstracted_axes``.

    Dynamic shapes exist only in ``jax.make_jaxpr`` (0.4.30 .. 0.8.1, with
    ``jax_dynamic_shapes`` on; broken from 0.7.2), so tracing goes through it,
    after a one-off probe that the installed JAX can do it with states.
    """
    _, dyn_args, _, dyn_kwargs = split
    if dyn_kwargs:
        raise NotImplementedError('abstracted_axes applies to positional arguments only; '
                                  'pass the dynamic arguments positionally')
    problem = _dynamic_shapes_problem()
    if problem is not None:
        raise NotImplementedError(
            f'abstracted_axes cannot be honoured by JAX {jax.__version__} ({problem}).  '
            "Dynamic shapes need JAX 0.4.30 .. 0.6.x with jax.config.update("
            "'jax_dynamic_shapes', True); otherwise drop abstracted_axes and trace once per "
            'concrete shape')
    treedef = jax.tree_util.tree_structure(dyn_args)

    def trace_with(flat_fun, avals):
        # Dynamic-shape tracing needs example arrays, not ShapeDtypeStructs.
        examples = jax.tree_util.tree_unflatten(
            treedef, [jnp.zeros(a.shape, a.dtype) for a in avals])
        closed = jax.make_jaxpr(lambda *args: flat_fun(*_leaves(args)),
                                abstracted_axes=abstracted_axes)(*examples)
        return closed.jaxpr, closed.out_avals, closed.consts
    return trace_with


_DYNAMIC_SHAPES_PROBES: dict = {}


def _dynamic_shapes_problem():
    """``None`` if abstracted_axes works with states here, else why not (cached)."""
    config = getattr(jax.config, 'jax_dynamic_shapes', None)
    if config in _DYNAMIC_SHAPES_PROBES:
        return _DYNAMIC_SHAPES_PROBES[config]
    if not _MAKE_JAXPR_HAS_ABSTRACTED_AXES:
        problem = 'jax.make_jaxpr has no abstracted_axes parameter'
    else:
        probe_state = State(jnp.zeros(()))

        def probe(flat_fun, avals):
            closed = jax.make_jaxpr(lambda x: flat_fun(x), abstracted_axes=('n',))(
                jnp.zeros(2, jnp.float32))
            return closed.jaxpr, closed.out_avals, closed.consts
        try:
            _trace_stateful(lambda x: x + probe_state.value, [ShapedArray((2,), jnp.float32)],
                            lambda flat: (flat, {}), name='probe', return_only_write=True,
                            trace_with=probe)
            problem = None
        except Exception as err:  # the probe only asks "does it work at all"
            problem = f'{type(err).__name__}: {err}'.strip()
    _DYNAMIC_SHAPES_PROBES[config] = problem
    return problem


# =============================================================================
# 7. StatefulFunction
#
# A traced function is only useful if calling it is as cheap as calling
# ``jax.jit``.  Each entry's *plan* (which states it reads, writes, donates)
# gets one jitted dispatcher, whose C++ cache keys on the state values and
# arguments; its miss re-enters Python in ``_dispatch_body``, which consults
# our own cache and inlines the entry's jaxpr into the jit trace (so that a
# first call traces the function once, as jax.jit does).  A call takes the
# *warm path* (``_call``: the last plan's dispatcher, no Python key), the
# *slow path* (key, entry, dispatcher), or, inside an enclosing stateful
# trace, the *in-trace path*: the states go through ``value`` so that the
# enclosing trace threads them.
# =============================================================================

class _PlanMismatch(Exception):
    """The dispatcher was called with a plan the arguments do not use."""


_plan_tokens = itertools.count(1)
# After this many plan switches a function stays on the slow path (see __call__).
_MAX_PLAN_SWITCHES = 3


# One lock per State, held from reading the states to writing them back, so
# that calls sharing a State run as in some sequential order.  Plans take them
# in one global order (by id: a plan keeps its States alive), and calls that
# share no State never wait for each other.
_state_locks = weakref.WeakKeyDictionary()


def _state_lock(state):
    return _state_locks.setdefault(state, threading.RLock())   # one atomic dict step


class _Plan:
    """Which states a compiled call reads, writes and donates (positions in
    ``states``), and their locks; shared by entries that agree."""
    __slots__ = ('token', 'states', 'write_states', 'write_index', 'donated', 'kept', 'locks')

    def __init__(self, states, write_index, donate):
        self.token = next(_plan_tokens)
        self.states = states
        self.write_index = write_index
        self.write_states = tuple(states[i] for i in write_index)
        self.donated = tuple(i for i in write_index if donate is not None
                             and donate((), states[i]))
        self.kept = tuple(i for i in range(len(states)) if i not in self.donated)
        self.locks = tuple(_state_lock(x) for x in sorted(states, key=id))


class _Entry:
    """One cache entry: the trace, its plan and how to apply it.  ``view`` is
    the trace the accessors describe (``get_jaxpr`` ...): ``traced`` itself,
    or for StatefulMapping a function that traces the whole mapped call."""
    __slots__ = ('traced', 'plan', 'apply', 'view')

    def __init__(self, traced, plan, apply, view):
        self.traced, self.plan, self.apply, self.view = traced, plan, apply, view


def _check_callable(fun, who: str):
    if isinstance(fun, (staticmethod, classmethod)):
        raise TypeError(
            f'{who} got a {type(fun).__name__} object; pass the underlying function '
            f'instead ({type(fun).__name__} objects are descriptors: use obj.__func__ or '
            'apply the decorator outside @staticmethod)')
    if not callable(fun):
        raise TypeError(f'{who} needs a callable, got {type(fun).__name__}: {fun!r}')
    if inspect.isgeneratorfunction(fun) or inspect.isasyncgenfunction(fun):
        raise TypeError(
            f'{who} cannot trace generator function {getattr(fun, "__qualname__", fun)!r}: '
            'a generator only runs when iterated; return a value (e.g. a list) instead')
    if inspect.iscoroutinefunction(fun):
        raise TypeError(f'{who} cannot trace coroutine function {fun!r}; make it synchronous')


def _write_back(fun, plan, new) -> None:
    """Gives ``plan``'s written states the values a compiled call returned."""
    if not new:
        return
    first = new[0]
    # An array value has an ``aval``; only a pytree value needs a walk.
    if isinstance(first, Tracer) or (getattr(first, 'aval', None) is None
                                     and _contains_tracer(first)):
        # Called under a plain JAX transformation: the new values are tracers.
        raise TraceContextError(
            f'{_who(fun)} writes {plan.write_states[0]._describe()} '
            'but was called inside a JAX transformation (jax.jit / jax.grad / jax.vmap ...) '
            'with no enclosing stateful trace, so the new state values would be tracers that '
            'outlive it.  Wrap the outer function in StatefulFunction, or call '
            'jaxpr_call(state_values, ...) and thread the values explicitly.')
    for state, value in zip(plan.write_states, new):
        state._value = value


def _constrain(value, sharding):
    """``value`` laid out as ``sharding`` inside a jit trace (``reshard`` where
    the mesh has Explicit axes, a sharding constraint otherwise)."""
    axis_types = getattr(getattr(sharding, 'mesh', None), 'axis_types', ())
    if _AXIS_EXPLICIT is not None and _AXIS_EXPLICIT in axis_types and _reshard is not None:
        return _reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)


def _kept_layout(state, new):
    """``new`` laid out like ``state``'s current value, leaf by leaf, where
    that spans several devices (inside the dispatcher's trace).  Without it
    XLA may gather a state it infers no sharding for onto one device."""
    old, tree = jax.tree_util.tree_flatten(state._value)
    leaves, new_tree = jax.tree_util.tree_flatten(new)
    if new_tree != tree:
        return new
    out = []
    for o, n in zip(old, leaves):
        sharding = _multi_device(o)
        if sharding is not None and np.shape(o) == np.shape(n):
            n = _constrain(n, sharding)
        out.append(n)
    return jax.tree_util.tree_unflatten(tree, out)


def _layout_token(sf, plan) -> int:
    """``plan``'s dispatcher key for the layout its written states have now."""
    layout = tuple(_multi_device(leaf) for state in plan.write_states
                   for leaf in _leaves(state._value))
    if not any(layout):
        return plan.token
    token = sf._layout_tokens.get((plan.token, layout))
    if token is None:
        token = sf._layout_tokens[(plan.token, layout)] = next(_plan_tokens)
        sf._plans_by_token[token] = plan
    return token


def _donating(sf, jitted, plan):
    """Calls the donating ``jitted`` as the plain dispatcher is called.  An
    array a donated state shares with another state is refused before the
    call, as JAX may crash on it."""
    def call(values, *args, **kwargs):
        owner = {}
        for i in plan.donated + plan.kept:
            for leaf in _leaves(values[i]):
                j = owner.setdefault(id(leaf), i)
                if j != i and j in plan.donated:
                    raise ValueError(
                        f'{_who(sf)} would donate the array that {plan.states[j]._describe()} '
                        f'and {plan.states[i]._describe()} both hold; give one of them a copy '
                        '(jnp.copy) or leave it out of donate_states')
        try:
            return jitted([values[i] for i in plan.donated],
                          [values[i] for i in plan.kept], *args, **kwargs)
        except BaseException as err:      # no State may keep a deleted buffer
            for state in (plan.states[i] for i in plan.donated):
                if any(isinstance(x, jax.Array) and x.is_deleted() for x in _leaves(state._value)):
                    state._broken = (
                        RuntimeError,
                        f'{state._describe()} has no value: its buffer was donated to a call '
                        f'of {_who(sf)} that then failed ({type(err).__name__}: {err}); assign '
                        'it a new value',
                        'buffer deleted by a failed donating call')
            raise
    return call


def _dispatch_donated(sf, token, donated, kept, *args, **kwargs):
    """The donating dispatcher's body: the donated values come apart."""
    plan = sf._plans_by_token[token]
    given = dict(zip(plan.donated + plan.kept, [*donated, *kept]))
    return sf._dispatch_body(token, [given[i] for i in range(len(plan.states))], *args, **kwargs)


def _warm_path(plan, dispatch, nargs, new):
    """``warm(sf, args, kwargs)``: the compiled call of ``plan`` with its locks,
    state reads and writes unrolled (a loop would cost a visible part of a
    jax.jit call).  ``new``, the values the call just returned, gives the type
    a written value has outside any JAX trace; another type (a tracer, a
    pytree) goes through _write_back's checks."""
    first = new[0] if new else None
    names = {'dispatch': dispatch, 'plan': plan, '_write_back': _write_back,
             'leaf_type': type(first) if getattr(first, 'aval', None) is not None else None,
             **{f's{i}': state for i, state in enumerate(plan.states)},
             **{f'l{i}': lock for i, lock in enumerate(plan.locks)}}
    locks = [f'l{i}' for i in range(len(plan.locks))]
    body = [f'values = [{"".join(f"s{i}._value, " for i in range(len(plan.states)))}]',
            'out, new = (dispatch(values, *args, **kwargs) if kwargs else '
            f'dispatch(values, {"".join(f"args[{i}], " for i in range(nargs))}))']
    if plan.write_index:
        body += ['if type(new[0]) is leaf_type:',
                 f'    {"".join(f"s{i}._value, " for i in plan.write_index)}= new',
                 'else:', '    _write_back(sf, plan, new)']
    lines = (['def warm(sf, args, kwargs):'] + [f'    {lock}.acquire()' for lock in locks]
             + ['    try:'] + [f'        {line}' for line in body] + ['    finally:']
             + ([f'        {lock}.release()' for lock in locks] or ['        pass'])
             + ['    next(sf._cache._hits)', '    return out'])
    exec('\n'.join(lines), names)
    return names['warm']


def _call(sf, *args, **kwargs):
    """``sf(*args, **kwargs)``: bound as ``__call__`` of every stateful function.

    The warm path (outside any trace, same number of positional arguments
    and same state layouts as the last call) is the last plan's _warm_path:
    jax.jit's C++ cache keys on the state values and the arguments, saving
    the slow path's Python key.  A call during which the dispatcher traced
    counts itself a miss in _dispatch_body.
    """
    if _frames_open and _ctx.frames:
        return sf._call_in_trace(args, kwargs)
    fast = sf._fast
    if fast is None or fast[1] != len(args) or fast[2] != _layout_epoch:
        return sf._call_slow(args, kwargs)
    try:
        return fast[0](sf, args, kwargs)
    except _PlanMismatch:
        # These arguments use other states.  Switching plans costs an aborted
        # trace, so a function that keeps switching gives up the fast path.
        sf._plan_switches += 1
        return sf._call_slow(args, kwargs)
    except (TypeError, ValueError) as err:
        if _ctx.trace_error is err:   # raised by the traced function itself
            raise
        # An argument jax.jit refuses gets the slow path's clearer error here,
        # and a static argument hashable only by value goes the slow path.
        # Anything else came from running the computation: never run it twice.
        sf._cache_key(args, kwargs)
        if sf._statics_by_value:
            return sf._call_slow(args, kwargs)
        raise


_real_value = operator.attrgetter('_value')     # a State's own value
_traced_value = operator.attrgetter('value')    # its value as the current trace sees it


class _StatefulBase:
    """Tracing, caching and calling, shared by StatefulFunction and StatefulMapping."""

    _compiled_dispatch = True   # StatefulMapping over jax.pmap turns it off
    __call__ = _call

    def __init__(self, fun, static_argnums, static_argnames, axis_env, abstracted_axes,
                 name, return_only_write, donate_states, keep_sharding, explain_cache_misses):
        _check_callable(fun, type(self).__name__)
        self.fun = fun
        self.static_argnums = _normalize_argnums(static_argnums, 'static_argnums')
        self.static_argnames = _normalize_argnames(static_argnames, 'static_argnames')
        self.axis_env = tuple(axis_env) if axis_env else None
        self.abstracted_axes = abstracted_axes
        self.name = name if name is not None else getattr(fun, '__name__', type(fun).__name__)
        self.return_only_write = return_only_write
        self.donate_states = donate_states
        self.keep_sharding = keep_sharding
        self._donate = None if donate_states in (None, False) else to_predicate(donate_states)
        self._keep = to_predicate(keep_sharding)
        if abstracted_axes is not None and not _MAKE_JAXPR_HAS_ABSTRACTED_AXES:
            raise NotImplementedError(
                f'abstracted_axes is not supported by the installed JAX {jax.__version__}: '
                'dynamic shapes were removed from jax.make_jaxpr in 0.8.2; drop '
                'abstracted_axes and trace once per concrete shape')
        self.explain_cache_misses = _explain_flag(explain_cache_misses)
        self._cache = BoundedCache(128)
        self._miss_causes: dict = {}   # why traces happened: cause -> count (_note_miss)
        self._hints = _TraceHints()
        self._key_locks = weakref.WeakValueDictionary()
        self._key_locks_guard = threading.Lock()
        self._reset_dispatch()
        functools.update_wrapper(self, fun, updated=())

    def _reset_dispatch(self):
        self._statics_by_value = False   # some static argument hashes only by value
        self._plans: dict = {}
        self._plans_by_token: dict = {}
        self._layout_tokens: dict = {}   # (plan token, layout) -> dispatcher key
        self._fast = None                # (warm path, nargs, layout epoch)
        self._plan_switches = 0
        self._dispatchers: dict = {}
        self._warm_paths: dict = {}      # dispatcher key -> its _warm_path

    # -- entries -----------------------------------------------------------------
    def _cache_key(self, args, kwargs):
        """``(key, flat_dynamic_leaves, split)`` for a call (see _call_key)."""
        key, leaves, split, by_value = _call_key(self, args, kwargs)
        if by_value:
            self._statics_by_value = True
        return key, leaves, split

    def _key_lock(self, key):
        # Weakly held: a lock lives only while some thread traces that key, so
        # evicted keys (and their static arguments) are not kept alive.
        with self._key_locks_guard:
            return self._key_locks.setdefault(key, threading.RLock())

    def _cached(self, key, read=_real_value, plan=None):
        """The entry under ``key`` (and for ``plan`` if given) if it was traced
        for its states' current shapes, as ``read(state)`` gives them."""
        entry = self._cache._peek(key)
        if entry is None or (plan is not None and entry.plan is not plan):
            return None
        fresh = all(_stale_sig(read(state), sig, True) is None
                    for state, sig in zip(entry.plan.states, entry.traced.state_sigs))
        return entry if fresh else None

    def _entry_for(self, key, leaves, split, *, count: bool, read=_real_value):
        """The valid entry for ``key``, tracing (once per key) when needed."""
        entry = self._cached(key, read)
        if entry is None:
            with self._key_lock(key):
                entry = self._cached(key, read)
                if entry is None:
                    stale, entry = self._cache._peek(key), self._build_entry(key, leaves, split)
                    _note_miss(self, key, stale, entry)
                    if entry.traced.cacheable:
                        self._cache._store(key, entry)
                    if count:
                        self._cache._record(False)
                    return entry
        if count:
            self._cache._record(True)
        return entry

    def _lookup(self, args, kwargs):
        """``(key, entry)`` for a call, traced if needed (counted as a call)."""
        key, leaves, split = self._cache_key(args, kwargs)
        return key, self._entry_for(key, leaves, split, count=True)

    def _plan_for(self, states, write_index) -> _Plan:
        plan_key = (tuple(map(id, states)), write_index)
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._plans[plan_key] = _Plan(states, write_index, self._donate)
            self._plans_by_token[plan.token] = plan
        return plan

    def _build_entry(self, key, leaves, split) -> _Entry:
        raise NotImplementedError

    # -- compiled calls ------------------------------------------------------------
    def _dispatcher(self, token: int, nargs: int, donating: bool = False):
        """The jitted call for one plan (and layout): ``dispatch(state_values,
        *args, **kwargs)``.  One jax.jit object per plan, rather than the plan
        as a static argument, saves hashing that argument on every call."""
        jitted = self._dispatchers.get((token, nargs, donating))
        if jitted is None:
            statics = _static_positions(self, nargs) if self.static_argnums else ()
            first = 2 if donating else 1          # where *args start
            body = functools.partial(_dispatch_donated, self) if donating else self._dispatch_body
            jitted = jax.jit(functools.partial(body, token),
                             static_argnums=tuple(i + first for i in statics),
                             static_argnames=self.static_argnames or None,
                             donate_argnums=(0,) if donating else ())
            if donating:
                jitted = _donating(self, jitted, self._plans_by_token[token])
            self._dispatchers[(token, nargs, donating)] = jitted
        return jitted

    def _dispatch_body(self, token, state_values, *args, **kwargs):
        """Runs only when the dispatcher's cache misses: traced by jax.jit.
        A negative ``token`` (``jaxpr_call``) leaves the layout to XLA."""
        plan = self._plans_by_token[abs(token)]
        if self._statics_by_value:
            args = tuple(a.value if isinstance(a, _StaticArg) else a for a in args)
            kwargs = {k: v.value if isinstance(v, _StaticArg) else v for k, v in kwargs.items()}
        key, leaves, split = self._cache_key(args, kwargs)
        given = dict(zip(map(id, plan.states), state_values))
        entry = self._cached(key, lambda state: given[id(state)], plan)
        if entry is None:
            ntraces = _ctx.ntraces
            entry = self._entry_for(key, leaves, split, count=False)
            if _ctx.ntraces != ntraces and token > 0:
                self._cache._record_retraced()   # the warm path counted a hit
            if entry.plan is not plan:
                raise _PlanMismatch
        out, new = entry.apply(list(state_values), leaves)
        if token > 0:
            new = [_kept_layout(state, value) if self._keep((), state) else value
                   for state, value in zip(plan.write_states, new)]
        return out, new

    def _run(self, entry, state_values, args, kwargs, leaves, token):
        """Runs ``entry`` on concrete values: compiled unless mapping with pmap.
        ``token`` is the dispatcher's static key: a negative one (``jaxpr_call``:
        the caller's values) donates nothing and leaves the layout to XLA."""
        if not self._compiled_dispatch or not entry.traced.cacheable:
            return entry.apply(state_values, leaves)
        if self._statics_by_value:
            args, kwargs = _wrap_statics(self, args, kwargs)
        donating = token > 0 and bool(entry.plan.donated)
        return self._dispatcher(token, len(args), donating)(state_values, *args, **kwargs)

    def _call_slow(self, args, kwargs):
        ntraces = _ctx.ntraces
        key, leaves, split = self._cache_key(args, kwargs)
        entry = self._entry_for(key, leaves, split, count=False)
        plan = entry.plan
        with contextlib.ExitStack() as held:
            for lock in plan.locks:
                held.enter_context(lock)
            epoch, token = _layout_epoch, _layout_token(self, plan)
            out, new = self._run(entry, [s._value for s in plan.states], args, kwargs, leaves,
                                 token)
            _write_back(self, plan, new)
        if (self._compiled_dispatch and entry.traced.cacheable and not self._statics_by_value
                and self._plan_switches < _MAX_PLAN_SWITCHES):
            key = (token, len(args), bool(plan.donated))
            warm = self._warm_paths.get(key)
            if warm is None:
                warm = _warm_path(plan, self._dispatcher(*key), len(args), new)
                self._warm_paths[key] = warm
            self._fast = (warm, len(args), epoch)
        else:
            self._fast = None
        self._cache._record(_ctx.ntraces == ntraces)
        return out

    def _call_in_trace(self, args, kwargs):
        """A call inside an enclosing stateful trace: the states are read and
        written through ``value``, so that the enclosing trace threads them."""
        key, leaves, split = self._cache_key(args, kwargs)
        ntraces = _ctx.ntraces
        entry = self._entry_for(key, leaves, split, count=False, read=_traced_value)
        out, new = entry.apply([s.value for s in entry.plan.states], leaves)
        for state, value in zip(entry.plan.write_states, new):
            state.value = value
        self._cache._record(_ctx.ntraces == ntraces)
        return out

    # -- cache management ----------------------------------------------------------
    def clear_cache(self) -> None:
        """Drops every cached trace and compiled executable (and the statistics)."""
        self._cache.clear()
        self._miss_causes = {}
        with self._key_locks_guard:
            self._key_locks.clear()
        self._reset_dispatch()

    def get_cache_stats(self) -> dict:
        """Statistics of the (single) entry cache, under brainstate's four names,
        and under ``'miss_causes'`` how many traces each cause triggered (see
        :func:`explain_cache_misses`)."""
        stats = self._cache.get_stats()
        out = {name: dict(stats) for name in
               ('jaxpr_cache', 'out_shapes_cache', 'jaxpr_out_tree_cache', 'state_trace_cache')}
        out['miss_causes'] = dict(self._miss_causes)
        return out


class _BrainstateAccessors:
    """The accessor surface of brainstate 0.2.1's StatefulFunction.

    Everything in this class follows brainstate's names, signatures and
    return types (``get_jaxpr``, ``get_out_shapes``, ``get_state_trace`` ...,
    their ``*_by_cache`` forms, ``validate_states``; and ``been_writen`` in
    StateTraceStack is brainstate's spelling), so code written for brainstate
    runs unchanged.  Each accessor describes the trace an entry's ``view``
    holds: for StatefulMapping the whole mapped call.
    """

    @staticmethod
    def _view(entry) -> _Traced:
        view = entry.view
        if type(view) is not _Traced:    # built on first use (StatefulMapping)
            view = entry.view = view()
        return view

    def _view_by_key(self, cache_key, context: str) -> _Traced:
        return self._view(self._cache.get(cache_key, raise_on_miss=True, error_context=context))

    def _view_by_args(self, args, kwargs, compile_if_miss: bool, context: str) -> _Traced:
        if compile_if_miss:
            return self._view(self._lookup(args, kwargs)[1])
        return self._view_by_key(self._cache_key(args, kwargs)[0], context)

    def get_jaxpr(self, *args, compile_if_miss: bool = True, **kwargs) -> ClosedJaxpr:
        """The ClosedJaxpr for these arguments."""
        return self._view_by_args(args, kwargs, compile_if_miss, 'JAX expression').closed_jaxpr

    def get_jaxpr_by_cache(self, cache_key) -> ClosedJaxpr:
        """The ClosedJaxpr stored under ``cache_key``."""
        return self._view_by_key(cache_key, 'JAX expression').closed_jaxpr

    def get_out_shapes(self, *args, compile_if_miss: bool = True, **kwargs):
        """``(out_shapes, state_shapes)`` as ``jax.ShapeDtypeStruct`` pytrees;
        ``state_shapes`` is a tuple with one entry per state (``get_states()``
        order), ``None`` for a state the jaxpr does not return."""
        return self._view_by_args(args, kwargs, compile_if_miss, 'Output shapes').out_shapes()

    def get_out_shapes_by_cache(self, cache_key):
        """:meth:`get_out_shapes` for a cache key."""
        return self._view_by_key(cache_key, 'Output shapes').out_shapes()

    def get_out_treedef(self, *args, compile_if_miss: bool = True, **kwargs):
        """The structure of ``(out, state_part)`` (see :meth:`get_out_shapes`):
        ``treedef.unflatten(jaxpr_outputs)`` gives ``(out, new_state_vals)``."""
        return self._view_by_args(args, kwargs, compile_if_miss, 'Output tree').full_tree

    def get_out_treedef_by_cache(self, cache_key):
        """:meth:`get_out_treedef` for a cache key."""
        return self._view_by_key(cache_key, 'Output tree').full_tree

    def get_state_trace(self, *args, compile_if_miss: bool = True, **kwargs) -> StateTraceStack:
        """The :class:`StateTraceStack` recorded while tracing."""
        return self._view_by_args(args, kwargs, compile_if_miss, 'State trace').trace_stack

    def get_state_trace_by_cache(self, cache_key) -> StateTraceStack:
        """:meth:`get_state_trace` for a cache key."""
        return self._view_by_key(cache_key, 'State trace').trace_stack

    def get_states(self, *args, compile_if_miss: bool = True, **kwargs) -> tuple:
        """Every touched State, in jaxpr-input order."""
        return self._view_by_args(args, kwargs, compile_if_miss, 'State trace').states

    def get_states_by_cache(self, cache_key) -> tuple:
        """:meth:`get_states` for a cache key."""
        return self._view_by_key(cache_key, 'State trace').states

    def get_read_states(self, *args, compile_if_miss: bool = True, **kwargs) -> tuple:
        """The touched States that are only read."""
        return tuple(self.get_state_trace(*args, compile_if_miss=compile_if_miss,
                                          **kwargs).get_read_states())

    def get_read_states_by_cache(self, cache_key) -> tuple:
        """:meth:`get_read_states` for a cache key."""
        return tuple(self.get_state_trace_by_cache(cache_key).get_read_states())

    def get_write_states(self, *args, compile_if_miss: bool = True, **kwargs) -> tuple:
        """The touched States that are written."""
        return tuple(self.get_state_trace(*args, compile_if_miss=compile_if_miss,
                                          **kwargs).get_write_states())

    def get_write_states_by_cache(self, cache_key) -> tuple:
        """:meth:`get_write_states` for a cache key."""
        return tuple(self.get_state_trace_by_cache(cache_key).get_write_states())

    def get_arg_cache_key(self, *args, compile_if_miss: bool = False, **kwargs) -> hashabledict:
        """The hashable cache key for these arguments (traces first if asked)."""
        if compile_if_miss:
            return self._lookup(args, kwargs)[0]
        return self._cache_key(args, kwargs)[0]

    def jaxpr_call_auto(self, *args, **kwargs):
        """Reads the states, runs, writes the written ones back; returns the output."""
        return self(*args, **kwargs)

    def validate_states(self, cache_key) -> bool:
        """``True`` if the entry's states still have their traced shapes, else ``ValueError``."""
        view = self._view_by_key(cache_key, 'State trace')
        for state, sig in zip(view.states, view.state_sigs):
            got = _stale_sig(state._value, sig)
            if got is not None:
                raise ValueError(
                    f'{state._describe()} changed from {sig} to {got} since it was traced; '
                    'the next call retraces (or call clear_cache())')
        return True

    def validate_all_states(self) -> dict:
        """``{cache_key: True or the error message}`` for every entry."""
        result = {}
        for key in self._cache.keys():
            try:
                result[key] = self.validate_states(key)
            except ValueError as err:
                result[key] = str(err)
        return result


class StatefulFunction(_BrainstateAccessors, _StatefulBase):
    """Traces a function that reads and writes States into a cached ``ClosedJaxpr``.

    The jaxpr's inputs are the flat dynamic arguments (positional, then
    keyword) followed by every State the function touches, in first-touch
    order; its outputs are the flat results followed by the written States
    (all touched States with ``return_only_write=False``).  One trace is
    cached per abstract signature of the arguments (static arguments by
    value).  Calling runs a compiled executable and writes the new state
    values back.

    Parameters
    ----------
    fun : callable
        The function to trace.
    static_argnums, static_argnames
        Arguments treated as compile-time constants (part of the cache key by
        value).  Negative positions count from the end.
    axis_env : sequence of (name, size), optional
        Named axes bound while tracing (for ``lax.axis_index`` / collectives).
    abstracted_axes : optional
        Dynamic-shape specification, on JAX releases that support it.
    name : str, optional
        Label for jaxprs and error messages (defaults to ``fun.__name__``).
    return_only_write : bool
        Return only written states from the jaxpr (default) or all touched ones.
    donate_states : filter, optional
        Written states matching it (``True``: every written state) have their
        old buffers donated to the compiled call, so XLA updates them in place
        (see README, "Many devices, many hosts").  Read-only states are never
        donated.  Off by default: an old value someone still holds becomes a
        deleted array.
    keep_sharding : filter
        Written states matching it (default: all) keep the sharding their
        value had, also where XLA would infer another; ``False`` (or a filter
        excluding a state) lets XLA choose.
    explain_cache_misses : bool, optional
        Log why each trace after the first happened (default: the module-wide
        setting, see :func:`explain_cache_misses`).

    Example
    -------
    >>> w = State(jnp.ones(2), name='w')
    >>> def f(x):
    ...     w.value = w.value * x
    ...     return w.value.sum()
    >>> sf = StatefulFunction(f)
    >>> float(sf(3.0)), w.value.tolist()
    (6.0, [3.0, 3.0])
    >>> len(sf.get_jaxpr(3.0).jaxpr.invars)   # x, then w
    2
    """

    def __init__(self, fun: Callable, static_argnums=(), static_argnames=(), axis_env=None,
                 abstracted_axes=None, name: str | None = None, return_only_write: bool = True,
                 *, donate_states=None, keep_sharding=True,
                 explain_cache_misses: bool | None = None):
        super().__init__(fun, static_argnums, static_argnames, axis_env, abstracted_axes,
                         name, return_only_write, donate_states, keep_sharding,
                         explain_cache_misses)

    def _build_entry(self, key, leaves, split) -> _Entry:
        traced = self._run_trace(leaves, split)
        run = traced.runner()

        def apply(state_values, flat_args):
            if self.abstracted_axes is not None:
                raise NotImplementedError(
                    f'{_who(self)} was built with abstracted_axes; its '
                    'dynamic-shape jaxpr is for inspection (make_jaxpr / get_jaxpr) only. '
                    'Create it without abstracted_axes to call it')
            return run(flat_args, state_values)
        return _Entry(traced, self._plan_for(traced.states, traced.returned), apply, traced)

    def _run_trace(self, leaves, split) -> _Traced:
        trace_with = None
        if self.abstracted_axes is not None:
            trace_with = _abstracted_tracer(self.abstracted_axes, split)
        return _trace_stateful(self.fun, [_aval_of(x) for x in leaves], _rebuilder(split),
                               name=self.name, return_only_write=self.return_only_write,
                               axis_env=self.axis_env, trace_with=trace_with, hints=self._hints)

    # -- public API --------------------------------------------------------------
    def make_jaxpr(self, *args, **kwargs) -> 'StatefulFunction':
        """Traces for these arguments on a cache miss; returns ``self``."""
        self._lookup(args, kwargs)
        return self

    def jaxpr_call(self, state_vals: Sequence, *args, **kwargs):
        """Pure call: ``(new_state_vals, out)`` from explicit state values.

        ``state_vals`` holds one value per touched state (``get_states`` order).
        ``new_state_vals`` is a tuple in the same order holding each returned
        state's new value and ``None`` for the others (the read-only states,
        unless ``return_only_write=False``).  Works under every JAX
        transformation.

        Example
        -------
        >>> s = State(jnp.zeros(()))
        >>> def f(x):
        ...     s.value = s.value + x
        ...     return x
        >>> sf = StatefulFunction(f)
        >>> new_vals, out = sf.jaxpr_call([jnp.ones(())], 2.0)
        >>> float(new_vals[0]), float(s.value)      # s itself is untouched
        (3.0, 0.0)
        """
        key, leaves, split = self._cache_key(args, kwargs)
        entry = self._entry_for(key, leaves, split, count=True)
        view = self._view(entry)
        states, state_vals = view.states, list(state_vals)
        if len(state_vals) != len(states):
            raise ValueError(
                f'State length mismatch: {_who(self)} touches '
                f'{len(states)} state(s) ({", ".join(_label(s) for s in states)}) '
                f'but jaxpr_call got {len(state_vals)} value(s); pass one value per state in '
                'get_states() order')
        for state, value, sig in zip(states, state_vals, view.state_sigs):
            got = _stale_sig(value, sig)
            if got is not None:
                raise ValueError(
                    f'jaxpr_call: the value given for {state._describe()} has structure/shapes '
                    f'{got}, but the function was traced with {sig}; pass a value of the '
                    'traced shape and dtype')
        # The compiled call takes and gives values in plan order (which a
        # StatefulMapping's view may permute); returned states not written
        # come back as given.
        where = {id(st): i for i, st in enumerate(states)}
        at = [where[id(st)] for st in entry.plan.states]
        out, new = self._run(entry, [state_vals[i] for i in at], args, kwargs, leaves,
                             -entry.plan.token)
        new_vals = [None] * len(states)
        for i in view.returned:
            new_vals[i] = state_vals[i]
        for j, value in zip(entry.plan.write_index, new):
            new_vals[at[j]] = value
        return tuple(new_vals), out

    def pretty_jaxpr(self, *args, **kwargs) -> str:
        """The jaxpr for these arguments (traced on a cache miss), followed by a
        legend: each input and output in order with the jaxpr's name for it,
        its aval and its role: an argument by position or keyword and pytree
        path (``argument 0['w'][1]``, ``keyword 'scale'``); a State by name
        (an unnamed one as ``Type@file.py:line``), type, whether the function
        reads it, writes it or both, and its creation site; a result by its
        path in the output; a state output as the State's new value.
        ``str(sf)`` shows the same for the most recently traced entry.

        Example
        -------
        >>> w = State(jnp.ones(2), name='w')
        >>> def f(x):
        ...     w.value = w.value * x['scale']
        ...     return w.value.sum()
        >>> text = StatefulFunction(f).pretty_jaxpr({'scale': 2.0})
        >>> print(text[text.index('inputs:'):])
        inputs:
          a  float32[]   argument 0['scale']
          b  float32[2]  state 'w' (State), read and written, created at ...
        outputs:
          ... float32[]   result
          ... float32[2]  state 'w': new value
        """
        key, entry = self._lookup(args, kwargs)
        return _pretty(self._view(entry), key)

    def __str__(self):
        return _str_with_jaxpr(self)

    def __repr__(self):
        return f'StatefulFunction({self.name!r}, entries={len(self._cache)})'


# =============================================================================


# =============================================================================
# 8. make_jaxpr
#
# ``jax.make_jaxpr`` for functions that touch States: a one-call wrapper over
# StatefulFunction returning the jaxpr and the States it reads and writes.
# =============================================================================

def make_jaxpr(fun: Callable, static_argnums=(), static_argnames=(), axis_env=None,
               return_shape: bool = False, abstracted_axes=None,
               return_only_write: bool = False, pretty: bool = False) -> Callable:
    """Like ``jax.make_jaxpr``, but States the function touches become inputs
    and outputs.

    Returns a function that returns ``(closed_jaxpr, states)``, or
    ``(closed_jaxpr, states, out_shapes)`` with ``return_shape=True``, or
    with ``pretty=True`` the jaxpr text followed by a legend of its inputs
    and outputs (see :func:`pretty_jaxpr`).  For a function that touches no
    State the jaxpr equals ``jax.make_jaxpr``'s.

    Example
    -------
    >>> s = State(jnp.zeros(2), name='s')
    >>> def f(x):
    ...     s.value += x                     # read and written
    ...     return s.value.sum()
    >>> jaxpr, states = make_jaxpr(f)(jnp.ones(2))
    >>> states == (s,), len(jaxpr.jaxpr.invars), len(jaxpr.jaxpr.outvars)
    (True, 2, 2)
    """
    sf = StatefulFunction(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                          axis_env=axis_env, abstracted_axes=abstracted_axes,
                          return_only_write=return_only_write)
    if pretty and return_shape:
        raise ValueError('make_jaxpr(pretty=True) returns the labelled jaxpr text, which has '
                         'no place for out_shapes; pass return_shape=True or pretty=True')

    @functools.wraps(fun)
    def make(*args, **kwargs):
        if pretty:
            return sf.pretty_jaxpr(*args, **kwargs)
        entry = sf._lookup(args, kwargs)[1]
        result = (entry.traced.closed_jaxpr, entry.traced.states)
        if return_shape:
            result += (entry.traced.out_shapes()[0],)
        return result
    return make


# =============================================================================
# 9. StatefulMapping
#
# A discovery trace of ``fun`` at per-lane shapes finds the states it touches
# and, by a dataflow pass over that jaxpr, which written values depend on the
# batch.  The state values are then handed to ``mapping_fn`` explicitly with
# per-state ``in_axes`` / ``out_axes``; no batching internals are needed.  The
# plan is cached per cache key, so a warm call does no discovery.
# =============================================================================

def _normalize_state_axes(spec, what: str) -> tuple:
    """``{axis: filter}`` or a bare filter (axis 0) → ``((axis, predicate), ...)``."""
    if spec is None:
        return ()
    items = list(spec.items()) if isinstance(spec, dict) else [(0, spec)]
    out = []
    for axis, filt in items:
        if not _is_int(axis):
            raise TypeError(f'{what} keys must be int axes, got {axis!r}; write '
                            f'{what}={{0: filter}} or {what}=filter')
        out.append((int(axis), to_predicate(filt)))
    return tuple(out)


def _axis_for(state, axes: tuple):
    for axis, predicate in axes:
        if predicate((), state):
            return axis
    return None


_UNEXPECTED_POLICIES = ('auto', 'warn', 'raise', 'ignore')


def _lane_axis(axis: int, aval, error: Callable) -> int:
    """``axis`` of ``aval`` counted from the front; raises ``error()`` if out of range."""
    nd = len(aval.shape)
    a = axis + nd if axis < 0 else axis
    if not 0 <= a < nd:
        raise error()
    return a


def _lane_aval(aval, axis: int):
    shape = tuple(aval.shape)
    return ShapedArray(shape[:axis] + shape[axis + 1:], aval.dtype, weak_type=aval.weak_type)


def _uses_axis_index(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == _AXIS_INDEX:
            return True
        if any(_uses_axis_index(j) for j in _nested_jaxprs(eqn.params)):
            return True
    return False


def _batched_outputs(jaxpr, in_batched: Sequence[bool], axis_name) -> list:
    """Which outputs of ``jaxpr`` vary across lanes, given which inputs do."""
    batched = {v for v, b in zip(jaxpr.invars, in_batched) if b}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        any_in = any(isinstance(v, Var) and v in batched for v in eqn.invars)
        if name == _AXIS_INDEX:
            out = True
        elif name in _COLLECTIVES and axis_name is not None:
            axes = _collective_axes(eqn)
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            out = any_in and axis_name not in axes
        else:
            out = any_in or any(_uses_axis_index(j) for j in _nested_jaxprs(eqn.params))
        if out:
            batched.update(eqn.outvars)
    return [isinstance(v, Var) and v in batched for v in jaxpr.outvars]


def _brainstate_order(states, in_axes, out_axes, rng_index) -> list:
    """The order brainstate's StatefulMapping touches states in: batched-in
    states grouped by axis, then the rest grouped by the axis they leave
    with, then the RandomStates split per lane."""
    def grouped(pairs):
        groups = {}
        for state, axis in pairs:
            groups.setdefault(axis, []).append(state)
        return [s for group in groups.values() for s in group]
    rng = [states[i] for i in rng_index]
    plain = [(i, s) for i, s in enumerate(states) if i not in rng_index]
    first = grouped((s, in_axes[i]) for i, s in plain if in_axes[i] is not None)
    rest = grouped((s, out_axes.get(i, in_axes[i])) for i, s in plain)
    return first + [s for s in rest if s not in first] + rng


def _leaf_axes(sf, split) -> list:
    static_args, dyn_args, static_kwargs, dyn_kwargs = split
    static_pos = {i for i, _ in static_args}
    nargs = len(dyn_args) + len(static_pos)
    spec = sf.in_axes
    if isinstance(spec, (tuple, list)):
        if len(spec) != nargs:
            raise ValueError(
                f'{_who(sf)}: in_axes has {len(spec)} entries but the '
                f'call passed {nargs} positional argument(s); give one axis (int or None) '
                'per positional argument, or a single int for all')
        per_arg = [spec[i] for i in range(nargs) if i not in static_pos]
    else:
        per_arg = [spec] * len(dyn_args)
    axes = []
    for i, (prefix, arg) in enumerate(zip(per_arg, dyn_args)):
        found = []
        try:
            jax.tree_util.tree_map(
                lambda p, sub: found.extend([p] * len(_leaves(sub))), prefix, arg,
                is_leaf=lambda x: x is None)
        except ValueError as err:
            raise ValueError(f'{_who(sf)}: in_axes entry {prefix!r} '
                             f'does not match argument {i}: {err}') from None
        axes += found
    axes += [0] * len(_leaves(dyn_kwargs))
    for ax in axes:
        if ax is not None and not _is_int(ax):
            raise ValueError(f'{_who(sf)}: in_axes entries must be int or None, got {ax!r}')
    return axes


def _lane_args(sf, leaves, split):
    """Per-lane avals and axes of the flat arguments, the sizes they imply,
    and their full avals."""
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(split[1])[0]]
    paths += [f'keyword {jax.tree_util.keystr(p)}' for p, _ in
              jax.tree_util.tree_flatten_with_path(split[3])[0]]
    lane_avals, arg_axes, sizes, avals = [], [], [], []
    for path, leaf, ax in zip(paths, leaves, _leaf_axes(sf, split)):
        aval = _aval_of(leaf)
        avals.append(aval)
        if ax is None:
            lane_avals.append(aval)
            arg_axes.append(None)
            continue
        a = _lane_axis(ax, aval, lambda: ValueError(
            f'{_who(sf)}: in_axes={ax} is out of range for argument leaf {path} of '
            f'shape {tuple(aval.shape)}'))
        sizes.append((f'argument {path} (axis {ax})', aval.shape[a]))
        lane_avals.append(_lane_aval(aval, a))
        arg_axes.append(a)
    return lane_avals, arg_axes, sizes, avals


def _batch_size(sf, sizes) -> int:
    """The one batch size all mapped arguments and states agree on."""
    if sf.axis_size is not None:
        sizes = sizes + [('axis_size', sf.axis_size)]
    distinct = {s for _, s in sizes}
    if len(distinct) > 1:
        listing = '\n'.join(f'  - {where}: {size}' for where, size in sizes)
        raise ValueError(f'{_who(sf)}: inconsistent batch sizes:\n{listing}\nall mapped '
                         'arguments and batched states must share one batch size')
    if not distinct:
        raise ValueError(
            f'{_who(sf)}: nothing is batched (no argument has an in_axes entry and no '
            'state matches state_in_axes), so the batch size is unknown; pass axis_size=n')
    return distinct.pop()


def _mapped_apply(sf, traced, n, arg_axes, state_axes, returned_pos, write_axes,
                  rng_index, nothing_batched):
    run = traced.runner()
    extra = {}
    if sf.axis_name is not None:
        extra['axis_name'] = sf.axis_name
    if nothing_batched:
        extra['axis_size'] = n

    def lane(lane_args, lane_states):
        out, returned = run(lane_args, lane_states)
        return out, [returned[r] for r in returned_pos]

    mapped = sf.mapping_fn(lane, in_axes=(list(arg_axes), list(state_axes)),
                           out_axes=(sf.out_axes, list(write_axes)), **extra)

    def apply(state_values, flat_args):
        values = list(state_values)
        new_keys = []
        for i in rng_index:
            keys = jax.random.split(values[i], n + 1)
            new_keys.append(keys[0])
            values[i] = keys[1:]
        out, written = mapped(list(flat_args), values)
        return out, list(written) + new_keys
    return apply


class StatefulMapping(StatefulFunction):
    """Maps a stateful function over a batch, like ``jax.vmap`` for States.

    States matched by ``state_in_axes`` are split along their axis on the way
    in and stacked on the way out; other states are broadcast.  Every touched
    :class:`RandomState` is split into one key per lane (as ``split_key(n)``
    would) and afterwards holds the advanced key.

    It is a :class:`StatefulFunction`: the accessors (``get_jaxpr``,
    ``get_states``, ``jaxpr_call`` ...) describe the whole mapped call, with
    full-size arguments and states, every touched state returned, and the
    states ordered as in brainstate: batched-in states by axis, then the
    others by the axis they leave with, then the RandomStates.

    Parameters
    ----------
    fun : callable
    in_axes, out_axes
        As for ``jax.vmap`` (keyword arguments are mapped over axis 0).
    state_in_axes, state_out_axes
        ``{axis: filter}`` or a bare filter (axis 0).  A state batched on the
        way in leaves batched on the same axis unless ``state_out_axes`` says
        otherwise.
    static_argnums, static_argnames, axis_env, name
        As for :class:`StatefulFunction`.
    axis_size : int, optional
        The batch size when nothing is batched.
    axis_name : hashable, optional
        Names the mapped axis for collectives (``lax.psum`` ...).
    mapping_fn : callable
        ``jax.vmap`` (default), ``jax.pmap``, or a shard_map-based mapper with
        the same signature.
    unexpected_out_state_mapping : {'auto', 'warn', 'raise', 'ignore'}
        What to do when an unbatched state is written with a batched value:
        leave it batched along axis 0 silently ('auto', 'ignore'), with a
        warning ('warn'), or raise :class:`BatchAxisError` ('raise').
    donate_states, keep_sharding, explain_cache_misses
        As for :class:`StatefulFunction`.

    Example
    -------
    >>> h = HiddenState(jnp.zeros((4, 3)), name='h')   # one row per lane
    >>> rng = RandomState(0)
    >>> def step(x):
    ...     h.value = h.value + x + jax.random.normal(rng.split_key(), (3,))
    ...     return h.value.sum()
    >>> f = StatefulMapping(step, in_axes=0, state_in_axes={0: HiddenState})
    >>> f(jnp.ones((4, 3))).shape
    (4,)
    """

    def __init__(self, fun: Callable, in_axes=0, out_axes=0, state_in_axes=None,
                 state_out_axes=None, static_argnums=(), static_argnames=(), axis_env=None,
                 abstracted_axes=None, axis_size: int | None = None, axis_name=None,
                 name: str | None = None, mapping_fn: Callable = jax.vmap,
                 unexpected_out_state_mapping: str = 'auto', *, donate_states=None,
                 keep_sharding=True, explain_cache_misses: bool | None = None):
        if abstracted_axes is not None:
            raise NotImplementedError('StatefulMapping does not support abstracted_axes; '
                                      'map over concrete shapes instead')
        _StatefulBase.__init__(self, fun, static_argnums, static_argnames, axis_env, None, name,
                               False, donate_states, keep_sharding, explain_cache_misses)
        self.origin_fun = fun
        if unexpected_out_state_mapping not in _UNEXPECTED_POLICIES:
            raise ValueError(
                f'unexpected_out_state_mapping must be one of {_UNEXPECTED_POLICIES}, got '
                f'{unexpected_out_state_mapping!r}')
        if axis_size is not None and (not _is_int(axis_size) or axis_size < 1):
            raise ValueError(f'axis_size must be a positive int, got {axis_size!r}')
        if not callable(mapping_fn):
            raise TypeError(f'mapping_fn must be callable like jax.vmap, got {mapping_fn!r}')
        self.in_axes, self.out_axes = in_axes, out_axes
        self.state_in_axes, self.state_out_axes = state_in_axes, state_out_axes
        self._state_in = _normalize_state_axes(state_in_axes, 'state_in_axes')
        self._state_out = _normalize_state_axes(state_out_axes, 'state_out_axes')
        self.unexpected_out_state_mapping = unexpected_out_state_mapping
        self.axis_size, self.axis_name, self.mapping_fn = axis_size, axis_name, mapping_fn
        # pmap compiles by itself, and jit-of-pmap warns: call it directly.
        self._compiled_dispatch = mapping_fn is not jax.pmap

    # -- discovery -------------------------------------------------------------
    def _build_entry(self, key, leaves, split) -> _Entry:
        lane_avals, arg_axes, sizes, avals = _lane_args(self, leaves, split)
        guess = sizes[0][1] if sizes else (self.axis_size or 1)
        traced, state_axes, state_sizes = self._discover(lane_avals, split, guess)
        if (self.axis_name is not None and state_sizes and not sizes
                and self.axis_size is None and state_sizes[0][1] != guess):
            # Collectives saw the guessed axis size: trace again with the real one.
            traced, state_axes, state_sizes = self._discover(lane_avals, split, state_sizes[0][1])
        n = _batch_size(self, sizes + state_sizes)
        states = traced.states
        rng_index = [i for i, s in enumerate(states)
                     if isinstance(s, RandomState) and state_axes[i] is None]
        in_state_axes = [0 if i in rng_index else state_axes[i] for i in range(len(states))]

        in_batched = [a is not None for a in arg_axes]
        for axis, sig in zip(in_state_axes, traced.state_sigs):
            in_batched += [axis is not None] * len(sig[1])
        ret_batched = self._returned_batched(traced, in_batched)

        mapped_write, write_axes = [], []
        for r, i in enumerate(traced.returned):
            if i in rng_index:          # a RandomState leaves with the advanced key
                continue
            axis = _axis_for(states[i], self._state_out)
            if axis is None:
                axis = state_axes[i]
            if axis is None and ret_batched[r]:
                self._unexpected(states[i])
                axis = 0
            mapped_write.append((r, i))
            write_axes.append(axis)
        plan = self._plan_for(states, tuple(i for _, i in mapped_write) + tuple(rng_index))
        apply = _mapped_apply(self, traced, n, arg_axes, in_state_axes,
                              [r for r, _ in mapped_write], write_axes, rng_index,
                              not any(in_batched))
        out_axes = dict(zip((i for _, i in mapped_write), write_axes))
        order = _brainstate_order(states, state_axes, out_axes, rng_index)
        entry = _Entry(traced, plan, apply, None)
        entry.view = functools.partial(self._trace_whole, order, avals, _rebuilder(split))
        return entry

    def _trace_whole(self, order, avals, rebuild) -> _Traced:
        """The accessors' view: the whole mapped call traced as one function."""
        def whole(*args, **kwargs):
            for state in order:
                state.value          # the first touch fixes the jaxpr input order
            return self(*args, **kwargs)
        return _trace_stateful(whole, avals, rebuild, name=self.name, return_only_write=False,
                               axis_env=self.axis_env)

    def _returned_batched(self, traced, in_batched) -> list:
        """For each returned state: does its new value vary across lanes?"""
        out_batched = _batched_outputs(traced.closed_jaxpr.jaxpr, in_batched, self.axis_name)
        first = traced.n_out
        positions = jax.tree_util.tree_unflatten(
            traced.state_tree, list(range(first, first + traced.state_tree.num_leaves)))
        return [any(out_batched[j] for j in _leaves(value)) for value in positions]

    def _discover(self, lane_avals, split, size):
        state_axes, state_sizes = {}, []

        def lift_aval(state, aval):
            axis = state_axes.get(id(state), _MISSING)
            if axis is _MISSING:
                axis = _axis_for(state, self._state_in)
                state_axes[id(state)] = axis
            if axis is None:
                return aval
            a = _lane_axis(axis, aval, lambda: BatchAxisError(
                f'state_in_axes maps {state._describe()} along axis {axis}, but its value '
                f'has shape {tuple(aval.shape)}; fix state_in_axes or the state\'s shape'))
            state_sizes.append((f'{state._describe()} (axis {axis})', aval.shape[a]))
            return _lane_aval(aval, a)

        axis_env = list(self.axis_env or ())
        if self.axis_name is not None:
            axis_env.append((self.axis_name, size))
        try:
            traced = _trace_stateful(self.fun, lane_avals, _rebuilder(split),
                                     name=self.name, return_only_write=True,
                                     axis_env=axis_env, lift_aval=lift_aval, hints=self._hints)
        except NameError as err:
            if 'axis' not in str(err) or self.axis_name is not None:
                raise
            raise NameError(
                f'{err}\n{_who(self)} maps its axis without a name; to use '
                'collectives (lax.psum, lax.pmean, lax.axis_index ...) over the mapped axis, '
                "pass axis_name='<name>' to StatefulMapping and use that name") from err
        # Axes stay as declared (negative too): the mapper resolves them per leaf.
        return traced, [state_axes.get(id(s)) for s in traced.states], state_sizes

    def _unexpected(self, state):
        policy = self.unexpected_out_state_mapping
        message = (f'{_who(self)}: {state._describe()} came in unbatched but '
                   'is written with a batched value, so it leaves batched along axis 0. '
                   'Declare it with state_in_axes (batched in) or state_out_axes (batched out)')
        if policy == 'raise':
            raise BatchAxisError(message + ", or set unexpected_out_state_mapping='auto'")
        if policy == 'warn':
            warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())

    def __repr__(self):
        return f'StatefulMapping({self.name!r}, entries={len(self._cache)})'


# =============================================================================
# 10. Inspecting and shipping
#
# Seeing what a stateful function became, and handing it on: jaxprs with a
# legend naming every input and output (``pretty_jaxpr``), explanations of
# why a function traced again (``explain_cache_misses``), and an export whose
# state inputs and outputs are named, loadable without the user's code
# (``export`` / ``deserialize``).  All of it runs on request or on the miss
# path; the warm call path is untouched.
# =============================================================================

def _sig_text(shape, dtype, weak_type: bool = False) -> str:
    """``float32[3,4]`` (``weak`` appended for a weakly typed value)."""
    return f'{dtype}[{",".join(map(str, shape))}]' + (' weak' if weak_type else '')


def _value_text(sig) -> str:
    """A state value signature from ``_value_sig`` in words."""
    treedef, leaves = sig
    texts = [_sig_text(*leaf) for leaf in leaves]
    if treedef.num_nodes == 1 and len(texts) == 1:
        return texts[0]
    paths = _leaf_paths(treedef)
    return '{' + ', '.join(f'{jax.tree_util.keystr(p)}: {t}' for p, t in zip(paths, texts)) + '}'


def _leaf_paths(treedef) -> list:
    """The key path of each leaf of ``treedef`` (rebuilt with placeholder leaves)."""
    try:
        tree = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
        return [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    except Exception:  # a pytree class whose unflatten checks its leaves
        return [(jax.tree_util.FlattenedIndexKey(i),) for i in range(treedef.num_leaves)]


def _arg_labels(key) -> list:
    """``argument 0['w'][1]`` / ``keyword 'scale'`` for each flat dynamic leaf of
    the call a cache key describes (positions count the static arguments too)."""
    static = {i for i, _ in key['static_args']}
    tree_a, tree_k = key['dyn_args'][0], key['dyn_kwargs'][0]
    positions = [i for i in range(len(tree_a.children()) + len(static)) if i not in static]
    labels = []
    for path in _leaf_paths(tree_a) + _leaf_paths(tree_k):
        head, rest = path[0], jax.tree_util.keystr(tuple(path[1:]))
        if isinstance(head, jax.tree_util.SequenceKey):
            labels.append(f'argument {positions[head.idx]}{rest}')
        elif isinstance(head, jax.tree_util.DictKey):
            labels.append(f'keyword {head.key!r}{rest}')
        else:
            labels.append(f'argument leaf {head.key}')
    return labels


def _static_items(key) -> list:
    """``(label, value)`` of each static argument in a cache key (values as hashed)."""
    return ([(f'static argument {i}', v) for i, v in key['static_args']]
            + [(f'static argument {k!r}', v) for k, v in key['static_kwargs']])


def _key_summary(key, limit: int = 6) -> str:
    """The call a cache key describes, in words: ``argument 0: float32[3], ...``."""
    sigs = key['dyn_args'][1] + key['dyn_kwargs'][1]
    items = [f'{label}: {_sig_text(*sig)}' for label, sig in zip(_arg_labels(key), sigs)]
    items += [f'{label}={value!r}' for label, value in _static_items(key)]
    more = f', ... ({len(items) - limit} more)' if len(items) > limit else ''
    return ', '.join(items[:limit]) + more or 'no arguments'


def _state_labels(states) -> list:
    """A readable label per state: its name or, for an unnamed one, its type and
    creation line (``RandomState@model.py:12``), the same from run to run.  A
    label used again gets ``#2``, ``#3`` ... in order."""
    labels, seen = [], {}
    for s in states:
        base = s._name
        if not base:
            site = s._source
            base = type(s).__name__ + (f'@{os.path.basename(site[0])}:{site[1]}' if site else '')
        seen[base] = n = seen.get(base, 0) + 1
        labels.append(base if n == 1 else f'{base}#{n}')
    return labels


def _state_roles(traced) -> list:
    """``'read'``, ``'written'`` or ``'read and written'`` per state of a trace.
    A written state counts as read when the jaxpr uses its incoming value."""
    jaxpr = traced.closed_jaxpr.jaxpr
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    used.update(v for v in jaxpr.outvars if isinstance(v, Var))
    invars = iter(jaxpr.invars[len(jaxpr.invars) - sum(len(s[1]) for s in traced.state_sigs):])
    roles = []
    for sig, written in zip(traced.state_sigs, traced.trace_stack.been_writen):
        read = any([next(invars) in used for _ in sig[1]]) or not written
        roles.append('read and written' if read and written else 'written' if written else 'read')
    return roles


def _jaxpr_names(text: str, n_in: int, n_out: int):
    """The names JAX printed for the jaxpr's inputs and outputs (it numbers
    variables while printing), or ``#i`` if the text has another layout."""
    # The main jaxpr's ``{ lambda`` starts a line; newer JAX prints shared
    # sub-jaxprs (``let _uniform = { lambda ...``) before it.
    head = re.search(r'^\{ lambda [^;]*;(.*?)\. let', text, re.S | re.M)
    tail = re.search(r'\bin \(([^()]*)\) \}\s*$', text, re.S)
    if head and tail:
        ins = [w.split(':')[0] for w in head.group(1).split()]
        outs = [w.strip().split(':')[0] for w in tail.group(1).split(',') if w.strip()]
        if (len(ins), len(outs)) == (n_in, n_out):
            return ins, outs
    return [f'#{i}' for i in range(n_in)], [f'#{i}' for i in range(n_out)]


def _pretty(traced: _Traced, key) -> str:
    """``traced``'s jaxpr followed by a legend of its inputs and outputs."""
    jaxpr, text = traced.closed_jaxpr.jaxpr, str(traced.closed_jaxpr)
    keystr = jax.tree_util.keystr
    labels, roles = _state_labels(traced.states), _state_roles(traced)
    args = _arg_labels(key)
    state_of, in_roles = [], []
    for i, (state, sig) in enumerate(zip(traced.states, traced.state_sigs)):
        for path in _leaf_paths(sig[0]):
            state_of.append(i)
            in_roles.append(f'state {labels[i]!r}{keystr(path)} ({type(state).__name__}), '
                            f'{roles[i]}, created at {_format_site(state._source)}')
    extra = len(jaxpr.invars) - len(args) - len(in_roles)   # abstracted_axes sizes
    in_roles = ['axis size (abstracted_axes)'] * extra + args + in_roles
    state_invars = {}
    for i, var in zip(state_of, jaxpr.invars[extra + len(args):]):
        state_invars.setdefault(i, set()).add(var)
    out_roles = [f'result{keystr(path)}' for path in _leaf_paths(traced.out_tree)]
    for path, var in zip(_leaf_paths(traced.state_tree), jaxpr.outvars[traced.n_out:]):
        i = traced.returned[path[0].idx]
        unchanged = isinstance(var, Var) and var in state_invars.get(i, ())
        out_roles.append(f'state {labels[i]!r}{keystr(tuple(path[1:]))}: '
                         + ('returned unchanged' if unchanged else 'new value'))
    names_in, names_out = _jaxpr_names(text, len(jaxpr.invars), len(jaxpr.outvars))
    sections = [('inputs', names_in, jaxpr.invars, in_roles),
                ('outputs', names_out, jaxpr.outvars, out_roles)]
    width = max([len(n) for n in names_in + names_out] + [1])
    awidth = max([len(v.aval.str_short()) for v in jaxpr.invars + jaxpr.outvars] + [1])
    lines = [text, '']
    for title, names, vars_, roles_ in sections:
        lines.append(f'{title}:')
        lines += [f'  {n:<{width}}  {v.aval.str_short():<{awidth}}  {r}'
                  for n, v, r in zip(names, vars_, roles_)]
    return '\n'.join(lines)


def _str_with_jaxpr(sf) -> str:
    """``repr(sf)``, then the labelled jaxpr of its most recently traced entry."""
    keys = sf._cache.keys()
    entry = sf._cache._peek(keys[-1]) if keys else None
    if entry is None:
        return f'{sf!r}, not traced yet'
    return (f'{sf!r}, last traced for ({_key_summary(keys[-1])}):\n'
            + _pretty(sf._view(entry), keys[-1]))


# -- Why a function traced again ----------------------------------------------

_logger = logging.getLogger(__name__)
_EXPLAIN_ENV = 'STATEFUL_JAXPR_EXPLAIN_CACHE_MISSES'
_explain_default = [os.environ.get(_EXPLAIN_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on')]


def explain_cache_misses(enabled: bool = True) -> bool:
    """Turns explanations of cache misses on or off for every function built
    without its own ``explain_cache_misses=`` argument; returns the previous
    setting.  The environment variable ``STATEFUL_JAXPR_EXPLAIN_CACHE_MISSES=1``
    turns them on at import (named after JAX's ``jax_explain_cache_misses``).

    With explanations on, every trace of a function after its first logs a
    warning on the ``stateful_jaxpr`` logger naming the function, the nearest
    cached entry and what differs: argument paths with old and new
    shape/dtype/weak type, static arguments with old and new value, States
    (name and creation site) whose shape or dtype changed, and States the new
    trace touches that the entry did not, or no longer touches.  Whether on
    or off, ``get_cache_stats()['miss_causes']`` counts traces per cause; a
    warm call does no extra work either way.

    Example
    -------
    >>> previous = explain_cache_misses(True)
    >>> sf = StatefulFunction(lambda x: x * 2)
    >>> _ = sf(jnp.ones(2)); _ = sf(jnp.ones(3))     # logs: argument 0: float32[2] -> float32[3]
    >>> sf.get_cache_stats()['miss_causes']
    {'first trace': 1, 'argument shape/dtype': 1}
    >>> _ = explain_cache_misses(previous)
    """
    _explain_flag(enabled)
    if enabled is None:
        raise TypeError('explain_cache_misses(enabled) needs True or False, got None')
    previous, _explain_default[0] = _explain_default[0], bool(enabled)
    return previous


def _explain_flag(value):
    """A constructor's ``explain_cache_misses`` argument, checked."""
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise TypeError(f'explain_cache_misses must be True, False or None (None follows '
                        f'stateful_jaxpr.explain_cache_misses()), got {value!r}')
    return None if value is None else bool(value)


def _key_differences(old, new, labels) -> list:
    """``(cause, line)`` for each way cache key ``new`` differs from ``old``;
    ``labels`` are ``new``'s argument labels (None: causes only, no lines)."""
    found, text = [], labels is not None
    if old['static_args'] != new['static_args'] or old['static_kwargs'] != new['static_kwargs']:
        olds, news = dict(_static_items(old)), dict(_static_items(new))
        for label in dict.fromkeys(list(olds) + list(news)):
            a, b = olds.get(label, _MISSING), news.get(label, _MISSING)
            if a != b:
                shown = ['(not passed)' if v is _MISSING else repr(v) for v in (a, b)]
                line = f'{label}: {shown[0]} -> {shown[1]}' if text else ''
                found.append(('static argument', line))
    offset = 0
    for part, what in (('dyn_args', 'positional'), ('dyn_kwargs', 'keyword')):
        (tree_a, sigs_a), (tree_b, sigs_b) = old[part], new[part]
        if tree_a != tree_b:
            found.append(('argument structure',
                          f'{what} argument structure: {tree_a} -> {tree_b}' if text else ''))
        elif sigs_a != sigs_b:
            found += [('argument shape/dtype', f'{labels[offset + i]}: {_sig_text(*a)} -> '
                       f'{_sig_text(*b)}' if text else '')
                      for i, (a, b) in enumerate(zip(sigs_a, sigs_b)) if a != b]
        offset += len(sigs_b)
    return found


def _state_differences(old_traced, new_traced) -> list:
    """``(cause, line)`` for States whose shape or dtype changed since
    ``old_traced``, and for States only one of the two traces touches."""
    if (new_traced.states == old_traced.states
            and new_traced.state_sigs == old_traced.state_sigs):
        return []   # (the new trace has just seen every State's current value)
    found = []
    for state, sig in zip(old_traced.states, old_traced.state_sigs):
        now = _value_sig(state._value)
        if now != sig:
            found.append(('state shape/dtype', f'{state._describe()}: {_value_text(sig)} -> '
                                               f'{_value_text(now)}'))
    old_ids = {id(s) for s in old_traced.states}
    new_ids = {id(s) for s in new_traced.states}
    found += [('new state', f'newly touched: {s._describe()}')
              for s in new_traced.states if id(s) not in old_ids]
    found += [('vanished state', f'no longer touched: {s._describe()}')
              for s in old_traced.states if id(s) not in new_ids]
    return found


def _note_miss(sf, key, stale, entry) -> None:
    """Counts why ``sf`` traced for ``key`` (``stale``: the entry it replaces)
    and, if asked, logs the explanation.  Runs only when a trace happened."""
    with sf._cache._lock:
        cached = list(sf._cache._data.items())   # least recently used first
        first = not sf._miss_causes
    enabled = sf.explain_cache_misses
    explain = not first and (_explain_default[0] if enabled is None else enabled)
    if first:
        found, near = [('first trace', '')], None
    elif stale is not None:
        near = key
        found = _state_differences(stale.traced, entry.traced)
    else:
        labels, best = _arg_labels(key) if explain else None, None
        for old_key, old in cached:   # the fewest differences; ties: most recently used
            diff = _key_differences(old_key, key, labels)
            if best is None or len(diff) <= len(best[2]):
                best = (old_key, old, diff)
        if best is None:
            found, near = [('no cached entry', 'no entry is cached (cleared, evicted or not '
                                               f'cacheable; cache_size={sf._cache.maxsize})')], None
        else:
            near, old, found = best
            found = found + _state_differences(old.traced, entry.traced)
    causes = list(dict.fromkeys(cause for cause, _ in found)) or ['unknown']
    with sf._cache._lock:
        for cause in causes:
            sf._miss_causes[cause] = sf._miss_causes.get(cause, 0) + 1
    if not explain:
        return
    nearest = 'none' if near is None else f'({_key_summary(near)})'
    lines = '\n'.join(f'  - {line}' for _, line in found if line) or \
        '  - nothing the cache key or the States show (the entry was not cacheable)'
    _logger.warning('%s(%r) traced again for (%s).\nNearest cached entry: %s%s\nWhat differs:\n%s',
                    type(sf).__name__, sf.name, _key_summary(key), nearest,
                    ' (the same arguments; its States changed)' if stale is not None else '',
                    lines)


# -- Export --------------------------------------------------------------------

_EXPORT_MAGIC = b'stateful_jaxpr.export\n'
_EXPORT_FORMAT = 1


# ``jax.export`` (public on 0.4.30 .. 0.12) serialises with the ``flatbuffers``
# package and, on 0.4.x, imports ``absl`` when loaded; ``pip install jax``
# installs neither.  It is therefore imported on first use, and a missing
# package is named (the rest of the module needs neither).
_EXPORT_PACKAGES = {'absl': 'absl-py', 'flatbuffers': 'flatbuffers'}


def _jax_export():
    """The ``jax.export`` module, or an ImportError naming the package to install."""
    missing = None
    try:
        from jax import export as module          # 0.4.30 ..
    except ImportError as err:
        missing = _EXPORT_PACKAGES.get((err.name or '').split('.')[0])
        if missing is None:
            raise
    if missing is None and importlib.util.find_spec('flatbuffers') is None:
        missing = 'flatbuffers'
    if missing is not None:
        raise ImportError(
            f'exporting needs the {missing!r} package, which jax.export uses on JAX '
            f'{jax.__version__} and `pip install jax` does not install: pip install {missing}')
    return module


class Exported:
    """A stateful function exported for given argument shapes, with a manifest
    naming its states: what :func:`export` returns and :func:`deserialize`
    loads (in a process that needs ``jax`` and this module only).

    Calling it as ``exported(*args, states={name: value, ...}, **kwargs)``
    (the dynamic arguments only: static ones were fixed at export) returns
    ``(outputs, new_states)``, where ``new_states`` maps each written state's
    name to its new value.  ``states`` must give every state the function
    reads (a written-only state may be given, and is ignored).

    Attributes
    ----------
    manifest : dict
        JSON-ready description: ``function``, ``jax_version``, ``platforms``,
        ``static_arguments``, ``arguments`` and ``results`` (path and aval per
        leaf), and ``states``: per State its ``name``, ``type``, ``role``
        (``'read'``, ``'written'`` or ``'read and written'``), ``created_at``
        and ``leaves`` (path, ``shape``, ``dtype``, and ``sharding`` where the
        state is sharded over several devices).
    exported : jax.export.Exported
        The underlying JAX export.

    Example
    -------
    >>> acc = State(jnp.zeros(3), name='acc')
    >>> def add(x):
    ...     acc.value = acc.value + x
    ...     return acc.value.sum()
    >>> ex = export(StatefulFunction(add), jnp.ones(3))
    >>> loaded = deserialize(ex.serialize())
    >>> out, new = loaded(jnp.ones(3), states={'acc': jnp.ones(3)})
    >>> float(out), new['acc'].tolist()
    (6.0, [2.0, 2.0, 2.0])
    """

    def __init__(self, exported, manifest: dict):
        self.exported = exported
        self.manifest = manifest

    def serialize(self, vjp_order: int = 0) -> bytes:
        """Bytes for :func:`deserialize`; ``vjp_order=n`` also stores ``n``
        orders of derivatives, so the loaded function can be differentiated
        (``jax.export``'s own argument)."""
        header = json.dumps(self.manifest, sort_keys=True).encode()
        return (_EXPORT_MAGIC + len(header).to_bytes(8, 'little') + header
                + bytes(self.exported.serialize(vjp_order=vjp_order)))

    def __call__(self, *args, states=None, **kwargs):
        name = f"exported {self.manifest['function']!r}"
        specs = {s['name']: s for s in self.manifest['states']}
        states = {} if states is None else states
        if not isinstance(states, dict):
            raise TypeError(f'{name}: states= must be a dict {{state name: value}}, got '
                            f'{type(states).__name__}')
        needed = [n for n, s in specs.items() if s['role'] != 'written']
        missing = [n for n in needed if n not in states]
        unknown = [n for n in states if n not in specs]
        if missing or unknown:
            problems = ([f'lacks {missing}'] if missing else []) + (
                [f'has names it does not know: {unknown}'] if unknown else [])
            listing = ', '.join(f"{n!r} ({s['role']})" for n, s in specs.items()) or 'none'
            raise ValueError(f'{name}: states= {" and ".join(problems)}; its states are: '
                             f'{listing}.  Pass states={{name: value}} for every state it reads')
        _check_leaves(name, 'the arguments', '', _leaves((args, kwargs)),
                      self.manifest['arguments'])
        for n, value in states.items():
            _check_leaves(name, f'state {n!r}', f'state {n!r}', _leaves(value), specs[n]['leaves'])
        values = {n: states[n] for n in needed}
        return self.exported.call(args, kwargs, values)

    def __repr__(self):
        roles = ', '.join(f"{s['name']!r} {s['role']}" for s in self.manifest['states'])
        return (f"Exported({self.manifest['function']!r}, platforms="
                f"{tuple(self.manifest['platforms'])}, states: {roles or 'none'})")


def _leaf_specs(labels, values) -> list:
    """Manifest rows ``{path, shape, dtype[, sharding]}`` for array leaves."""
    rows = []
    for label, value in zip(labels, values):
        shape, dtype, _ = _leaf_sig(value)
        row = {'path': label, 'shape': list(shape), 'dtype': str(dtype)}
        if _multi_device(value) is not None:
            row['sharding'] = str(value.sharding)
        rows.append(row)
    return rows


def _check_leaves(name: str, what: str, prefix: str, leaves, specs) -> None:
    """Clear errors for leaves (of ``what``) that do not match the manifest's
    ``specs``; a leaf is named ``prefix`` + its manifest path."""
    if len(leaves) != len(specs):
        expected = ', '.join(f"{prefix}{s['path']}" for s in specs) or 'none'
        raise ValueError(f'{name}: {what} have {len(leaves)} array leaves, but it was exported '
                         f'for {len(specs)} ({expected})')
    for leaf, spec in zip(leaves, specs):
        try:
            got = _sig_text(*_leaf_sig(leaf)[:2])
        except TypeError:
            got = f'a {type(leaf).__name__}'
        if got != _sig_text(spec['shape'], spec['dtype']):
            raise ValueError(
                f"{name}: {prefix}{spec['path']} is {got}, but it was exported for "
                f"{_sig_text(spec['shape'], spec['dtype'])}; pass a value of that shape and dtype")


def _export_names(sf, states) -> list:
    """The states' names, which must exist and be unique (they key ``states=``)."""
    names = [s._name for s in states]
    bad = [s for s in states if not s._name or names.count(s._name) > 1]
    if bad:
        listing = '\n'.join(f'  - {s._describe()}' + ('' if s._name else ' (no name)')
                            for s in bad)
        raise ValueError(
            f'export: the exported function takes and returns its states by name, but these '
            f'States of {_who(sf)} have no name or share one:\n{listing}\n'
            "Give each a unique name (State(..., name='w') or state.name = 'w')")
    return names


def export(fun, *args, platforms: Sequence[str] | None = None, **kwargs) -> Exported:
    """Exports ``fun(*args, **kwargs)`` with ``jax.export``, its States becoming
    named inputs and outputs; returns an :class:`Exported`.

    ``fun`` is a :class:`StatefulFunction`, a :class:`StatefulMapping` or a
    plain function (wrapped in a StatefulFunction).  The arguments fix the
    shapes (static arguments are fixed by value); every State the function
    touches needs a unique name.  ``platforms`` is ``jax.export``'s (e.g.
    ``['cpu', 'cuda']``; default: the current backend).  No State changes.
    Serialising needs the ``flatbuffers`` package (and ``absl-py`` on JAX
    0.4.x), which ``pip install jax`` does not install: an ImportError names
    the missing one.

    Example
    -------
    >>> w = State(jnp.full(2, 3.0), name='w')
    >>> ex = export(lambda x: (x * w.value).sum(), jnp.ones(2))
    >>> ex.manifest['states'][0]['name'], ex.manifest['states'][0]['role']
    ('w', 'read')
    """
    module = _jax_export()
    sf = fun if isinstance(fun, _StatefulBase) else StatefulFunction(fun)
    key, leaves, split = sf._cache_key(args, kwargs)
    traced = sf._view(sf._entry_for(key, leaves, split, count=True))
    names, roles = _export_names(sf, traced.states), _state_roles(traced)
    static_args, dyn_args, static_kwargs, dyn_kwargs = split
    rebuild = _rebuilder(split)
    read = [role != 'written' for role in roles]

    def pure(dyn_args, dyn_kwargs, state_values):
        values = [state_values[n] if r else jax.tree_util.tree_unflatten(
                      sig[0], [jnp.zeros(shape, dtype) for shape, dtype, _ in sig[1]])
                  for n, r, sig in zip(names, read, traced.state_sigs)]
        full_args, full_kwargs = rebuild(_leaves((dyn_args, dyn_kwargs)))
        new, out = sf.jaxpr_call(values, *full_args, **full_kwargs)
        return out, {n: v for n, v, role in zip(names, new, roles) if role != 'read'}

    inputs = {n: s._value for n, s, r in zip(names, traced.states, read) if r}
    exported = module.export(jax.jit(pure), platforms=platforms)(dyn_args, dyn_kwargs, inputs)
    out_paths = [f'result{jax.tree_util.keystr(p)}' for p in _leaf_paths(traced.out_tree)]
    manifest = {
        'format': _EXPORT_FORMAT, 'function': sf.name, 'jax_version': jax.__version__,
        'platforms': list(exported.platforms),
        'static_arguments': {label: repr(v) for label, v in
                             [(f'argument {i}', v) for i, v in static_args]
                             + [(f'keyword {k!r}', v) for k, v in static_kwargs.items()]},
        'arguments': _leaf_specs(_arg_labels(key), leaves),
        'results': [{'path': p, 'shape': list(a.shape), 'dtype': str(a.dtype)}
                    for p, a in zip(out_paths, traced.out_avals)],
        'states': [{'name': n, 'type': type(s).__name__, 'role': role,
                    'created_at': _format_site(s._source),
                    'leaves': _leaf_specs([jax.tree_util.keystr(p) for p in _leaf_paths(sig[0])],
                                          _leaves(s._value))}
                   for n, s, role, sig in zip(names, traced.states, roles, traced.state_sigs)],
    }
    return Exported(exported, manifest)


def deserialize(data) -> Exported:
    """Loads bytes from :meth:`Exported.serialize` (no user code needed).

    Example
    -------
    >>> n = State(jnp.zeros(()), name='n')
    >>> def count(x):
    ...     n.value = n.value + 1
    ...     return x * n.value
    >>> loaded = deserialize(export(count, 2.0).serialize())
    >>> out, new = loaded(2.0, states={'n': jnp.float32(4.0)})
    >>> float(out), float(new['n'])
    (10.0, 5.0)
    """
    data = bytes(data)
    if not data.startswith(_EXPORT_MAGIC):
        raise ValueError('deserialize: these bytes were not made by stateful_jaxpr\'s '
                         'Exported.serialize() (bytes from jax.export load with '
                         'jax.export.deserialize)')
    start = len(_EXPORT_MAGIC) + 8
    end = start + int.from_bytes(data[len(_EXPORT_MAGIC):start], 'little')
    manifest = json.loads(data[start:end])
    if manifest.get('format') != _EXPORT_FORMAT:
        raise ValueError(f"deserialize: export format {manifest.get('format')!r}, but this "
                         f'stateful_jaxpr reads format {_EXPORT_FORMAT}; load it with the '
                         'stateful_jaxpr that wrote it')
    return Exported(_jax_export().deserialize(bytearray(data[end:])), manifest)


# =============================================================================
# 11. Jaxpr passes: constant folding
#
# A traced stateful function often computes from constants only (tables,
# masks, initial values); folding evaluates those equations once, at trace
# time, and leaves a smaller jaxpr with the same interface.
# =============================================================================

class IdentitySet(MutableSet):
    """A mutable set of objects compared by identity (for unhashable values
    such as arrays).

    Example
    -------
    >>> a = np.zeros(2)
    >>> s = IdentitySet([a, a])
    >>> len(s), a in s, np.zeros(2) in s
    (1, True, False)
    """

    def __init__(self, iterable: Iterable | None = None):
        self._data: dict = {}
        for value in iterable or ():
            self.add(value)

    def add(self, value) -> None:
        self._data[id(value)] = value

    def discard(self, value) -> None:
        self._data.pop(id(value), None)

    def __contains__(self, value) -> bool:
        return id(value) in self._data

    def __iter__(self):
        return iter(list(self._data.values()))

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self):
        return f'IdentitySet({list(self._data.values())!r})'


# Never evaluated at fold time: their value must come from running the program.
# A folded value larger than this (in elements) and larger than the inputs
# would only materialise a big constant (e.g. broadcast_in_dim of a scalar).
_FOLD_MAX_GROWTH = 1024


def _numel(aval) -> int:
    return int(math.prod(getattr(aval, 'shape', ()) or ()))


def _foldable(eqn, values) -> bool:
    name = eqn.primitive.name
    if not eqn.invars or eqn.effects or name in _NO_FOLD_PRIMITIVES:
        return False
    if any(part in name for part in _NO_FOLD_PARTS) or _nested_jaxprs(eqn.params):
        return False
    if any(v is _MISSING or isinstance(v, Tracer) for v in values):
        return False
    out_size = sum(_numel(v.aval) for v in eqn.outvars)
    in_size = sum(_numel(v.aval) for v in eqn.invars)
    return out_size <= max(in_size, _FOLD_MAX_GROWTH)


def _fold(jaxpr, consts, in_values=None):
    """Folds ``jaxpr``.

    Returns ``(new_jaxpr, out_values)``: ``new_jaxpr`` is closed over the new
    consts unless ``consts`` is ``None`` (a bare Jaxpr), and ``out_values[i]``
    is the known value of output ``i`` (or ``_MISSING``).  ``in_values`` gives
    known values for the inputs, used to evaluate a call whose arguments are
    all known.
    """
    known = {}        # Var -> value known at fold time
    if in_values is not None:
        known.update(zip(jaxpr.invars, in_values))
    const_values = dict(zip(jaxpr.constvars, consts)) if consts is not None else {}

    def value_of(atom):
        if isinstance(atom, Literal):
            return atom.val
        return known[atom] if atom in known else const_values.get(atom, _MISSING)

    eqns = []
    for eqn in jaxpr.eqns:
        values = [value_of(v) for v in eqn.invars]
        outs = _evaluate(eqn, values)
        if outs is not None:
            known.update(zip(eqn.outvars, outs))
        else:
            eqns.append(_fold_call_body(eqn) if _eqn_is_call(eqn) else eqn)
    out_values = [value_of(v) for v in jaxpr.outvars]
    return _inline_known(jaxpr, consts, eqns, known), out_values


def _evaluate(eqn, values):
    """``eqn``'s outputs if it can be folded with these input values, else None."""
    if _eqn_is_call(eqn):
        return _fold_call(eqn, values)   # known only if the whole body folds
    if not _foldable(eqn, values):
        return None
    try:
        outs = eqn.primitive.bind(*values, **eqn.params)
    except Exception:  # e.g. a primitive with no eager rule: keep it
        return None
    return outs if eqn.primitive.multiple_results else [outs]


def _eqn_is_call(eqn) -> bool:
    return eqn.primitive.name in _CALL_PRIMITIVES


def _inline_known(jaxpr, consts, eqns, known):
    """``jaxpr`` with ``eqns``, whose inputs of known value become literals
    (scalars, or every value of a bare Jaxpr) or new consts; unused consts
    are dropped."""
    invars = set(jaxpr.invars)
    constvars = list(jaxpr.constvars)
    new_consts = list(consts) if consts is not None else None
    replacement = {}  # folded Var -> Literal or new constvar

    def substitute(atom):
        if isinstance(atom, Literal) or atom not in known or atom in invars:
            return atom
        if atom not in replacement:
            val = known[atom]
            if np.shape(val) == () or new_consts is None:
                replacement[atom] = Literal(np.asarray(val), atom.aval)
            else:
                constvars.append(atom)
                new_consts.append(val)
                replacement[atom] = atom
        return replacement[atom]

    eqns = [eqn.replace(invars=[substitute(v) for v in eqn.invars]) for eqn in eqns]
    outvars = [substitute(v) for v in jaxpr.outvars]
    used = {v for eqn in eqns for v in eqn.invars if isinstance(v, Var)}
    used.update(v for v in outvars if isinstance(v, Var))
    keep = [i for i, v in enumerate(constvars) if v in used]
    if new_consts is not None:
        new_consts = [new_consts[i] for i in keep]
    return _rebuild(jaxpr, new_consts, constvars=[constvars[i] for i in keep], eqns=eqns,
                    outvars=outvars)


def _call_body(eqn):
    for name in _CALL_BODY_PARAMS:
        body = eqn.params.get(name)
        if isinstance(body, (ClosedJaxpr, Jaxpr)):
            return name, body
    return None, None


def _fold_call(eqn, values):
    """The outputs of a call whose inputs are known, if its body folds completely."""
    name, body = _call_body(eqn)
    if body is None or eqn.effects or any(v is _MISSING or isinstance(v, Tracer)
                                          for v in values):
        return None
    if isinstance(body, ClosedJaxpr):
        _, outs = _fold(body.jaxpr, list(body.consts), values)
    else:
        _, outs = _fold(body, None, values)
    if any(v is _MISSING for v in outs):
        return None
    return outs


def _fold_call_body(eqn):
    name, body = _call_body(eqn)
    if body is None:
        return eqn
    return eqn.replace(params={**eqn.params, name: constant_fold_jaxpr(body)})


def constant_fold_jaxpr(jaxpr):
    """Evaluates every equation whose inputs are all known and inlines the results.

    Accepts a ``Jaxpr`` or ``ClosedJaxpr`` and returns the same kind with the
    same interface (invars, outvar avals and debug info), so it evaluates with
    the original arguments to the same numbers.  Never folded: equations
    without inputs, random-number primitives, control flow, callbacks and
    other effectful primitives, and equations that would only materialise a
    large constant.  Bodies of nested ``pjit``/``closed_call`` are folded too.

    Example
    -------
    >>> table = jnp.array([0.0, 1.0, 2.0])
    >>> def f(x):
    ...     c = jnp.exp(table) * 2 + 1         # depends on constants only
    ...     return x + c
    >>> cj = jax.make_jaxpr(f)(jnp.ones(3))
    >>> folded = constant_fold_jaxpr(cj)
    >>> len(folded.eqns) < len(cj.eqns)
    True
    """
    if isinstance(jaxpr, ClosedJaxpr):   # every Jaxpr from 0.11 on
        return _fold(jaxpr.jaxpr, list(jaxpr.consts))[0]
    if isinstance(jaxpr, Jaxpr):
        return _fold(jaxpr, None)[0]
    raise TypeError(f'constant_fold_jaxpr needs a Jaxpr or ClosedJaxpr, got '
                    f'{type(jaxpr).__name__}')


# =============================================================================
# 12. Demo: ``python stateful_jaxpr.py``
#
# The public API end to end, on a small recurrent network: printing a labelled
# jaxpr, running a compiled step, mapping it over a batch with per-lane keys.
# =============================================================================

def main() -> None:
    """A short tour: trace a stateful function, show its jaxpr, call it."""
    print(f'stateful_jaxpr on jax {jax.__version__}\n')
    weight = ParamState(jnp.array([0.5, -1.0, 2.0]), name='weight')
    trace = LongTermState(jnp.zeros(3), name='trace')
    count = State(jnp.array(0), name='count')

    def step(x):
        trace.value = 0.9 * trace.value + x      # a running statistic
        count.value = count.value + 1
        return jnp.dot(weight.value, trace.value)

    sf = StatefulFunction(step)
    x = jnp.ones(3)
    print('1. step(x) traced to a jaxpr; the states it touches become inputs, the ones it')
    print('   writes become outputs (sf.pretty_jaxpr(x)):\n')
    print(sf.pretty_jaxpr(x))
    print('\n2. calling it runs a compiled executable and updates the states:')
    for i in range(3):
        y = sf(x)
        print(f'   call {i}: out={float(y):+.4f}  trace={trace.value}  count={int(count.value)}')
    print('\n3. cache statistics:', sf.get_cache_stats()['jaxpr_cache'])

    rng = RandomState(0, name='rng')
    h = HiddenState(jnp.zeros((4, 3)), name='h', tag='per_lane')

    def noisy(inp):
        h.value = h.value + inp + 0.1 * jax.random.normal(rng.split_key(), (3,))
        return h.value.mean()

    sm = StatefulMapping(noisy, in_axes=0, state_in_axes={0: 'per_lane'})
    out = sm(jnp.ones((4, 3)))
    print('\n4. StatefulMapping over 4 lanes, one random key per lane:')
    print(f'   out={np.round(np.asarray(out), 3)}')
    print(f'   h=\n{np.round(np.asarray(h.value), 3)}')


if __name__ == '__main__':
    main()
