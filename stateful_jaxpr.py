# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""Imperative, mutable ``State`` objects that trace into pure, cached JAX programs.

Write ``state.value += x`` in ordinary Python and still use ``jit``, ``vmap``, ``grad`` and
``scan``.  :class:`StatefulFunction` traces a function over :class:`State` objects into a
``ClosedJaxpr`` whose extra inputs and outputs are those states, caches it per abstract signature
and runs it compiled; :class:`StatefulMapping` maps one over a batch with per-state batch axes and
per-lane random keys.  The file depends on ``jax`` only: copy it into your project.  Its numbered
sections follow the data flow, from the compatibility shims (the only place that touches JAX
internals) to a demo ``main()``.  It uses these words in a sense of its own:
stack: a StateTraceStack open in the thread: brainstate's recorder, an _EagerCall, a _TraceFrame.
  One class in three roles, because brainstate's recorder with ``new_arg`` is already an overlay:
  an eager call and a trace need just that, a trace also lifting values to jaxpr inputs; so a
  State's first touch under any of them is recorded by the one ``StateTraceStack._touch``.
first touch: a State's first read or write under a stack, which records it (a trace: as new inputs).
overlay: a stack holding what code inside reads and writes of each State, the State left as it was.
side slot: a State's name, metadata, stack level or backup key, which an overlay holds like a value.
cell: a State lifted as Refs, one per leaf, so that writes inside nested transformations get out.
level: a cell's value in one differentiation it is touched in, with that differentiation's tangents.
improvised: said of a cell made at a write, in a trace redone with the State a cell from the start.
peel: to replace each tracer of an ended differentiation in a State written there by its primal.
epoch: a size-1 named axis no jaxpr uses, bound while tracing: JAX keys its caches on bound axes.
isolate, isolated run: to trace under a fresh epoch, so that JAX reuses no body it cached before.
baked: said of a State a plain JAX trace read: a jaxpr JAX cached may hold its value as a constant.
entry: what the cache keeps per call signature: the trace, its plan and how to run it (_Entry).
plan: which States a compiled call reads, writes and donates, with its jitted dispatchers (_Plan).
token: a plan's number, which keys its dispatchers; each multi-device layout of its States gets one.
warm path, slow path: a call reusing the last call's plan and dispatcher; one looking its entry up.
door: a function holding the locks of the States it changes, all or none, from read to write.

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

import collections.abc
import contextlib
import enum
import functools
import gc
import hashlib
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
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    'State', 'ShortTermState', 'LongTermState', 'ParamState', 'BatchState', 'HiddenState',
    'RandomState', 'TreefyState', 'catch_new_states', 'check_state_value_tree', 'StateTraceStack',
    'to_predicate', 'OfType', 'WithTag', 'Any', 'All', 'Not', 'Everything', 'Nothing',
    'BoundedCache', 'make_hashable', 'hashabledict', 'StatefulFunction', 'make_jaxpr', 'grad',
    'checkpoint', 'remat', 'StatefulMapping', 'explain_cache_misses', 'export', 'deserialize',
    'Exported', 'constant_fold_jaxpr', 'IdentitySet', 'TraceContextError', 'BatchAxisError',
]


# =============================================================================
# 1. Compatibility shims
#
# Tracing over States needs what JAX keeps private: the current trace, new jaxpr inputs,
# mutable references and their discharge, primitive names, ``params`` keys, error texts, the
# printed jaxpr.  Only this section touches them; each probe names the releases it serves.
# =============================================================================

import jax.extend.core as _jex_core               # all releases
import jax.extend.linear_util as _lu              # all releases
import jax.extend.source_info_util as _siu        # all releases
from jax.interpreters import partial_eval as _pe  # all releases
import jax._src.core as _src_core                 # all releases


def _probe(*paths):
    """The first of the ``'module:attr.attr'`` paths this JAX has, else None."""
    for module, _, attrs in (path.partition(':') for path in paths):
        with contextlib.suppress(ImportError, AttributeError):
            return functools.reduce(getattr, attrs.split('.'), importlib.import_module(module))


def _takes(fun, parameter: str) -> bool:
    return fun is not None and parameter in inspect.signature(fun).parameters


ClosedJaxpr, Jaxpr = _jex_core.ClosedJaxpr, _jex_core.Jaxpr   # one class from 0.11
Literal, Var, _jaxpr_as_fun = _jex_core.Literal, _jex_core.Var, _jex_core.jaxpr_as_fun
Tracer, ShapedArray = jax.core.Tracer, jax.core.ShapedArray   # all releases
_literal = Literal   # _literal(value, aval): a jaxpr's inline constant (all releases)
_typeof = _probe('jax:typeof', 'jax.api_util:shaped_abstractify')    # 0.5.3 .. | before
_CONSTS_ON_JAXPR = _probe('jax.extend.core:Jaxpr.with_consts') is not None   # 0.11 ..
_make_debug_info = _probe('jax.api_util:debug_info')   # 0.5.1 .. (wrap_init warns without it)
_extend_axis_env = _probe('jax._src.core:extend_axis_env_nd')  # all releases
_EPOCH_AXES = itertools.count()   # numbers _fresh_epoch's axes
_AXIS_EXPLICIT = _probe('jax.sharding:AxisType.Explicit')      # 0.5 ..
_reshard = _probe('jax.sharding:reshard', 'jax.experimental.shard:reshard')  # 0.7 | 0.5 ..
_PmapSharding = _probe('jax._src.sharding_impls:PmapSharding') or ()   # jax.pmap's, .. 0.9
_jit_takes = lambda sharding: not isinstance(sharding, _PmapSharding)   # noqa: E731 (as a layout)
# XLA may run a host callback on a thread of its own (0.10 ..), a dummy one to Python: whose call
# it serves is unknown there.
_on_xla_thread = lambda: isinstance(threading.current_thread(), threading._DummyThread)  # noqa: E731
_mapped_aval = _src_core.mapped_aval   # an aval less one axis, its sharding's too (all releases)
_MAKE_JAXPR_HAS_ABSTRACTED_AXES = _takes(jax.make_jaxpr, 'abstracted_axes')  # .. 0.8.1
_JaxprTrace = _probe('jax._src.interpreters.partial_eval:DynamicJaxprTrace')   # all releases
_LinearizeTrace = _probe('jax._src.interpreters.ad:LinearizeTrace')   # 0.4.38 ..
_NEW_ARG_TAKES_SOURCE_INFO = _takes(_JaxprTrace.new_arg, 'source_info')   # 0.6.1 ..
# ``arg_names=None`` keeps state inputs clear of jax_enable_checks' arity check (0.7 ..).
_ARG_NAMES_MAY_BE_NONE = _probe('jax._src.linear_util:DebugInfo.assert_arg_names') is not None
# Mutable references (jax._src.state, all releases): a State written inside a nested
# transformation is held as Refs while tracing; JAX's ``discharge_state`` threads writes out.
_ref_aval = _probe('jax._src.state.types:AbstractRef')
_ref_get = _probe('jax._src.state.primitives:ref_get')   # ref_get(ref, ()): all of it
_ref_set = _probe('jax._src.state.primitives:ref_set')
_discharge_state = _probe('jax._src.state.discharge:discharge_state')
_RefEffect = _probe('jax._src.state.types:RefEffect')
_ReadEffect = _probe('jax._src.state.types:ReadEffect')
_HAS_REFS = None not in (_ref_aval, _ref_get, _ref_set, _discharge_state, _RefEffect)
_DISCHARGE_TAKES_CLOSED = _takes(_discharge_state, 'closed_jaxpr')   # 0.10 ..
# A Ref made inside a differentiated function carries tangents, through loop bodies too (0.7 ..).
_new_ref = _probe('jax:new_ref')   # 0.7.2 ..
_NO_REFS = f'that needs mutable references (jax._src.state), which JAX {jax.__version__} lacks'
_ref_type = functools.lru_cache(maxsize=1024)(_ref_aval or (lambda aval: None))  # (copies aval)
_is_ref = functools.partial(type.__instancecheck__, _ref_aval)   # whether an aval is a Ref's
# A Ref's value is strongly typed (all releases): a weak copy of a value, as a loop carry keeps it.
_weakly = functools.partial(_probe('jax._src.lax.lax:_convert_element_type') or (
    lambda x, weak_type: x), weak_type=True)

# JAX leaves its own frames out of a user's traceback (jax_traceback_filtering) at its API
# boundaries: this file's frames too, at the module's boundaries (all releases).
_api_boundary = _probe('jax._src.traceback_util:api_boundary') or (lambda fun: fun)
(_probe('jax._src.traceback_util:register_exclusion') or (lambda path: None))(__file__)
# A jax.jit signature whose first call raised (a trace aborted) stays on JAX's slow Python path
# for good; clearing the function's C++ cache lets it back, its traces and executables kept.
_forget_failed_calls = operator.methodcaller('_clear_cache')   # all releases
# Settings that change what a trace builds (dtypes, promotion, precision, keys, the meshes in
# context), which jax.jit keys its caches on too: a trace made under others is not reused (all
# releases; one a release lacks reads None).
_TRACE_SETTINGS = {name: functools.partial(getattr, jax.config, name, None) for name in (
    'jax_enable_x64', 'jax_numpy_dtype_promotion', 'jax_numpy_rank_promotion',
    'jax_default_matmul_precision', 'jax_default_prng_impl', 'jax_threefry_partitionable',
    'jax_softmax_custom_jvp', 'jax_random_seed_offset', 'jax_high_dynamic_range_gumbel')}
_with_mesh = _probe('jax._src.config:mesh_context_manager')   # ``with mesh:``
_abstract_mesh_now = _probe('jax._src.mesh:get_abstract_mesh') or (lambda: None)
_TRACE_SETTINGS.update({
    'mesh': _probe('jax._src.mesh:get_concrete_mesh') or (lambda: None),   # jax.set_mesh
    'abstract mesh': lambda: _abstract_mesh_now() or None,   # (0.4.38: () outside a jit, None in)
    'with mesh': lambda: getattr(_with_mesh, 'value', None),
    # Any other in JAX's trace context, which jax.jit keys its traces on: all but the axis
    # environment, which a run binds itself (the places it changes, probed; all releases).
    'other': lambda: tuple(None if v == () else v for i, v in enumerate(_trace_context())
                           if i not in _axis_env_places())})
_trace_context = _probe('jax._src.config:trace_context') or tuple


@functools.lru_cache(maxsize=None)
def _axis_env_places() -> frozenset:
    plain = _trace_context()
    with _axis_env([('stateful_jaxpr.probe', 1)] if _extend_axis_env else ()):
        return frozenset(i for i, (a, b) in enumerate(zip(plain, _trace_context())) if a != b)


def _settings() -> tuple:
    return tuple(get() for get in _TRACE_SETTINGS.values())


def _rebuild(jaxpr, consts, **fields):
    """``jaxpr`` with ``fields`` replaced, closed over ``consts`` (None: open)."""
    if fields:
        fields.setdefault('debug_info', getattr(jaxpr, 'debug_info', None))
        jaxpr = jaxpr.replace(**fields)
    if consts is None:
        return jaxpr
    return jaxpr.with_consts(list(consts)) if _CONSTS_ON_JAXPR else ClosedJaxpr(jaxpr, list(consts))


def _nested_jaxprs(params) -> list:
    return [i for v in params.values() for i in (v if isinstance(v, (tuple, list)) else (v,))
            if isinstance(i, (ClosedJaxpr, Jaxpr))]


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _nested_jaxprs(eqn.params):
            yield from _all_eqns(sub)


def _per_jaxpr(fun):
    """``fun`` of a nested jaxpr, kept while the jaxpr lives: the body of a nested
    StatefulFunction reappears whole in the trace of each one around it."""
    memo = weakref.WeakKeyDictionary()   # (jaxprs hash by identity, on all releases)
    return lambda j: got if (got := memo.get(j)) is not None else memo.setdefault(j, fun(j))


def _nested_consts(eqns) -> list:
    """The constants of the closed jaxprs nested, at any depth, in ``eqns``."""
    return [c for e in eqns for i in _nested_jaxprs(e.params) for c in _consts_within(i)]


@_per_jaxpr
def _consts_within(jaxpr) -> tuple:
    return (*getattr(jaxpr, 'consts', ()), *_nested_consts(getattr(jaxpr, 'jaxpr', jaxpr).eqns))


def _staged_eqns(trace) -> list:
    """What a jaxpr ``trace`` staged: ``frame.eqns`` (.. 0.6), ``frame.tracing_eqns`` (0.7 ..)."""
    eqns = getattr(trace.frame, 'tracing_eqns', None) or getattr(trace.frame, 'eqns', ())
    return [e for e in (e() if callable(e) else e for e in eqns) if e is not None]


def _map_eqns(jaxpr, fun):
    """``jaxpr`` (open or closed) with ``fun`` mapped over its equations, nested ones included;
    arg names JAX's discharge dropped filled in (0.7's while JVP adds to a condition's)."""
    inner = getattr(jaxpr, 'jaxpr', jaxpr)
    info = getattr(inner, 'debug_info', None)
    nest = lambda v: (type(v)(map(nest, v)) if type(v) in (tuple, list) else   # noqa: E731
                      _map_eqns(v, fun) if isinstance(v, (ClosedJaxpr, Jaxpr)) else v)
    eqns = [new if (new := fun(e)) is not e or not _nested_jaxprs(e.params)
            else e.replace(params={k: nest(v) for k, v in e.params.items()}) for e in inner.eqns]
    return _rebuild(inner, getattr(jaxpr, 'consts', None), eqns=eqns, debug_info=info and (
        info._replace(arg_names=('',) * len(inner.invars)) if info.arg_names is None else info))


# JAX's discharge inlines a custom_jvp / custom_vjp call in a body it discharges, dropping its
# rule (0.10 ..): each such call that touches no Ref crosses the discharge as a placeholder.
_kept_p = _jex_core.Primitive('stateful_jaxpr_kept_call')
_kept_p.multiple_results = True
_kept_p.def_effectful_abstract_eval(lambda *_, eqn: ([v.aval for v in eqn.outvars], eqn.effects))
# Calls keeping a custom derivative rule ('custom_vjp_call_jaxpr' .. 0.5).
_CUSTOM_CALLS = frozenset({'custom_jvp_call', 'custom_vjp_call', 'custom_vjp_call_jaxpr'})


def _discharge(closed):
    """``closed`` made pure, Ref inputs as values and finals as extra outputs, custom rules kept;
    a NotImplementedError where JAX cannot thread state out of some transformation."""
    closed = _map_eqns(closed, lambda e: e.replace(primitive=_kept_p, params={'eqn': e}) if (
        e.primitive.name in _CUSTOM_CALLS
        and not any(isinstance(f, _RefEffect) for f in e.effects)) else e)
    pure = (_discharge_state(closed) if _DISCHARGE_TAKES_CLOSED
            else _rebuild(*_discharge_state(closed.jaxpr, closed.consts)))
    return _map_eqns(pure, lambda e: e.params['eqn'].replace(invars=e.invars, outvars=e.outvars)
                     if e.primitive is _kept_p else e)


def _picked(jaxpr, picks, like):
    """``jaxpr`` (open) giving its outputs ``picks`` (indices) and only the equations they need:
    JAX's discharge leaves an iteration counter in every loop (all releases); the debug info
    ``like``'s, its result paths unknown ('') but as many as the outputs (0.5 ..)."""
    info = getattr(like, 'debug_info', None)
    info = info and info._replace(result_paths=('',) * len(picks))
    jaxpr = _rebuild(jaxpr, None, outvars=[jaxpr.outvars[i] for i in picks], debug_info=info)
    jaxpr = _pe.dce_jaxpr(jaxpr, [True] * len(picks), instantiate=True)[0]
    return _rebuild(jaxpr, None, debug_info=info)   # (dce_jaxpr drops arg names on 0.5, 0.6)


@_per_jaxpr
def _has_custom_rules(jaxpr) -> bool:
    return any(e.primitive.name in _CUSTOM_CALLS or any(
        _has_custom_rules(getattr(j, 'jaxpr', j)) for j in _nested_jaxprs(e.params))
        for e in jaxpr.eqns)


def _drops_jvp_refs(jaxpr) -> bool:
    """Whether JAX's JVP drops the tangent Ref it made for a body writing an outer Ref (.. 0.6)."""
    return not _new_ref and any(e.primitive.name == 'mutable_array' for e in _all_eqns(jaxpr))


# The current trace, and the traces it is nested in (all releases: one object per trace).
# From JAX 0.10 trace_ctx.trace is a property over this config value; every warm call asks.
_trace_ref = _probe('jax._src.core:trace_state_strong_ref')   # 0.10 ..
_current_trace = (functools.partial(getattr, _trace_ref, 'value') if _trace_ref is not None
                  else functools.partial(getattr, _src_core.trace_ctx, 'trace'))   # .. 0.9
_tracer_trace = operator.attrgetter('_trace')
_TraceSet = weakref.WeakSet   # of traces: they hash by identity and are weakly referable (all)
_at_trace = _src_core.set_current_trace      # binds at a trace other than the current one
_eager = _src_core.EvalTrace.__instancecheck__   # outside any transformation (C: warm calls ask)
_stages = _JaxprTrace.__instancecheck__   # builds a jaxpr: a jit, loop, cond or checkpoint body
_jvps = _probe('jax._src.interpreters.ad:JVPTrace').__instancecheck__   # jax.jvp; reverse .. 0.6
_linearizes = _LinearizeTrace.__instancecheck__   # jax.linearize, jax.grad, jax.vjp: 0.7 ..


def _under_jax_trace() -> bool:
    return not _eager(_current_trace())


def _parent(trace):
    return getattr(trace, 'parent_trace', None)   # (on every trace from 0.6)


def _trace_path(home) -> tuple:
    """``(traces, whole)``: the current trace and its parents up to ``home``, innermost first;
    ``whole`` False on .. 0.5, where a jit or loop body has no parent (``parent_trace``, 0.6 ..),
    None in a trace JAX made apart from the program (a custom rule's, traced when JAX needs it)."""
    path, trace = [], _src_core.trace_ctx.trace
    while trace is not home and not _eager(trace):
        path.append(trace)
        if (trace := _parent(trace)) is None:
            return path, None if hasattr(path[-1], 'parent_trace') else False
    return path, True


def _made_for(trace) -> str:   # what JAX builds ``trace``'s jaxpr for: its debug info says
    return str(getattr(getattr(getattr(trace, 'frame', None), 'debug_info', None), 'traced_for', ''))


def _body_of(trace) -> str:
    """'checkpoint' where ``trace`` builds a jax.checkpoint body, 'cond' a lax.cond / switch
    branch, 'loop' a scan, fori_loop or while_loop body or condition ('while...'), 'mapped' a
    shard_map or pmap body, else '' (its debug info: 'checkpoint / remat' from 0.7, 'checkpoint'
    before; 'while_loop' for a body .. 0.5; 'xla_pmap' .. 0.4)."""
    kind = _made_for(trace)
    return ('checkpoint' if kind.startswith('checkpoint') else 'cond' if kind in ('cond', 'switch')
            else 'loop' if kind in ('scan', 'fori_loop') or kind.startswith('while')
            else 'mapped' if kind in ('shard_map', 'pmap', 'xla_pmap') else '')


def _tells(path, trace) -> bool:
    """Whether the traces ``path`` (innermost first, maybe cut short) tell if they are inside
    ``trace``: it is among them, or a parent of it is (then they are outside it)."""
    parent = _parent(trace)
    while parent is not None and parent not in path:
        parent = _parent(parent)
    return trace in path or parent is not None


def _primal(x, trace):
    """``x`` seen from outside the differentiation ``trace``: its primal (a tracer's ``primal``)."""
    return x.primal if getattr(x, '_trace', None) is trace else x


def _drops_ref_tangents(home) -> bool:
    """Whether a Ref written now, in a jaxpr trace inside a JVP trace inside ``home``,
    would lose its tangent silently (.. 0.5, where the path is not whole; later JAX refuses)."""
    todo, seen = [_src_core.trace_ctx.trace], set()
    if not _stages(todo[0]) or todo[0] is home or _trace_path(home)[1]:
        return False
    while todo:   # the jaxpr being built closes over a JVP trace's value?
        for value in getattr(todo.pop().frame, 'constvar_to_val', {}).values():
            if _jvps(owner := getattr(value, '_trace', None)) or _linearizes(owner):
                return True
            if _stages(owner) and owner is not home and id(owner) not in seen:
                seen.add(id(owner))
                todo.append(owner)
    return False


def _diff_refs(value, avals, refs) -> list:
    """Refs of ``value``'s leaves made at the current trace, a differentiation (0.7 ..), but
    ``refs``'s for those without derivatives: 0.8 .. 0.10 transpose no loop writing new int Refs."""
    return [_new_ref(x) if jnp.issubdtype(a.dtype, jnp.inexact) else r
            for x, a, r in zip(jax.tree_util.tree_leaves(value), avals, refs)]


def _tied(value, ref):
    """``value``, tied to ``ref``'s by a select: 0.8 .. 0.10 transpose no loop writing a value
    with no derivative into a Ref made inside the differentiation (refused: 'transpose')."""
    return jax.lax.select(True, value, _ref_get(ref, ()))


def _set_refs(refs, values, primal: bool) -> None:
    """Writes ``values`` into ``refs``, their primals if ``primal``; refused, the other (.. 0.5)."""
    for ref, value in zip(refs, values):
        try:
            _ref_set(ref, (), jax.lax.stop_gradient(value) if primal else value)
        except Exception:   # (.. 0.5: in a body JAX cannot tell which a Ref takes)
            _ref_set(ref, (), value if primal else jax.lax.stop_gradient(value))


def _new_arg(trace, aval):
    return trace.new_arg(aval, *((_siu.current(),) if _NEW_ARG_TAKES_SOURCE_INFO else ()))


def _trace_to_jaxpr(flat_fun: Callable, in_avals: Sequence, fun: Callable, name: str):
    """``(jaxpr, out_avals, consts)`` of ``flat_fun(*leaves)`` (a 4-tuple up to 0.6)."""
    dbg = {}
    if _make_debug_info is not None:
        names = None if _ARG_NAMES_MAY_BE_NONE else tuple(f'arg{i}' for i in range(len(in_avals)))
        dbg['debug_info'] = _make_debug_info(name, fun, (), {})._replace(arg_names=names)
    return _pe.trace_to_jaxpr_dynamic(_lu.wrap_init(flat_fun, **dbg), list(in_avals))[:3]


def _axis_env(axis_env):
    """Context binding named axes ``[(name, size), ...]`` while tracing."""
    if axis_env and _extend_axis_env is None:
        raise NotImplementedError('binding named axes needs jax._src.core.extend_axis_env_nd, '
                                  f'which JAX {jax.__version__} lacks')
    return _extend_axis_env(list(axis_env)) if axis_env else contextlib.nullcontext()


def _fresh_epoch(shared: bool = False):
    """A context under which JAX's caches of traced bodies and jitted functions miss: they key
    on the axis environment (all releases), so a unique size-1 axis no jaxpr uses isolates;
    ``shared``: one fixed axis, whose caches every run binding it shares."""
    return _axis_env([(f'stateful_jaxpr.epoch{"" if shared else next(_EPOCH_AXES)}', 1)])


def _body_binding(eqn) -> tuple:
    """``(bodies, operands, carry)`` of a cond, while, scan or call: the bodies' inputs are fed
    ``operands``; a loop's output k carries its input ``carry + k`` (None: any may reach any)."""
    p, name = eqn.params, eqn.primitive.name
    if name == 'cond':   # all releases: operands after the index
        return [b.jaxpr for b in p['branches']], eqn.invars[1:], None
    if name == 'while':   # all releases: the condition's consts, the body's, carries
        return [p['body_jaxpr'].jaxpr], eqn.invars[p['cond_nconsts']:], p['body_nconsts']
    if name == 'scan':   # consts, carries, xs; counted .. 0.10 | in 'ft_in' 0.11 ..
        n = p['num_consts'] if 'num_consts' in p else len(p['ft_in'].unpack()[0])
        return [p['jaxpr'].jaxpr], eqn.invars, n
    body = _call_body(eqn)[1]
    return ([], (), None) if body is None else ([getattr(body, 'jaxpr', body)], eqn.invars, None)


def _hoisted_scan(eqn, ats):
    """``(equations, outputs)`` running ``eqn`` where it is a scan whose body returns carries
    unchanged (``ats``: _returned_inputs) through lax.scan, which makes them constants (0.6 ..),
    else None ('num_carry' .. 0.10, 'ft_in' 0.11 ..; 'length', 'reverse', 'unroll' all)."""
    if eqn.primitive.name != 'scan' or eqn.params.get('_split_transpose'):
        return None
    p, n = eqn.params, _body_binding(eqn)[2]
    k = p['num_carry'] if 'num_carry' in p else len(p['ft_in'].unpack()[1])
    if all(j is None for j in ats[0][:k]):
        return None

    def run(*ops):
        def step(carry, xs):
            out = _jaxpr_as_fun(p['jaxpr'])(*ops[:n], *carry, *xs)
            return list(out[:k]), list(out[k:])
        carry, ys = jax.lax.scan(step, list(ops[n:n + k]), list(ops[n + k:]), length=p['length'],
                                 reverse=p['reverse'], unroll=p['unroll'])
        return [*carry, *ys]
    try:
        scan, _, consts = _trace_to_jaxpr(run, [v.aval for v in eqn.invars], run, 'scan')
    except TypeError:   # (carries of two types, as JAX's discharge leaves some .. 0.5)
        return None
    to = dict(zip(scan.invars, eqn.invars, strict=True))
    at = lambda v: to.get(v, v) if isinstance(v, Var) else v   # noqa: E731
    if consts or any(at(scan.outvars[i]) is scan.outvars[i] for i, j in enumerate(ats[0])
                     if j is not None):   # (lax.scan forwards none .. 0.5)
        return None
    return [e.replace(invars=list(map(at, e.invars))) for e in scan.eqns], map(at, scan.outvars)


def _call_body(eqn) -> tuple:
    """``(param, body)`` of a call ('jaxpr' or 'call_jaxpr'), else ``(None, None)``: 'pjit' became
    'jit' in 0.7, 'closed_call' / 'core_call' 'eval_jaxpr' in 0.11."""
    return next(((k, eqn.params[k]) for k in ('jaxpr', 'call_jaxpr') if eqn.primitive.name in (
        'pjit', 'jit', 'closed_call', 'core_call', 'eval_jaxpr') and isinstance(
            eqn.params.get(k), (ClosedJaxpr, Jaxpr))), (None, None))


def _folds(eqn) -> bool:
    """Whether an equation may be evaluated at fold time, a body aside: effects, randomness,
    callbacks, placement, axis queries and linearize's deferred tangents may not (all releases)."""
    return not eqn.effects and not any(part in eqn.primitive.name for part in ('random_', 'rng_',
                   'threefry', 'callback', 'debug_', 'device_put', 'axis_index', 'custom_lin'))


def _written_refs(eqn, numbered: bool = True) -> set:
    """The inputs of ``eqn`` (not ``numbered``: ``{True}``) whose Refs it writes, by its effects:
    numbered by ``input_index`` up to 0.9, ``input`` from 0.10."""
    return {True if not numbered else e.input if getattr(e, 'input_index', None) is None
            else eqn.invars[e.input_index] for e in eqn.effects
            if isinstance(e, _RefEffect) and not isinstance(e, _ReadEffect)}


def _write_hazard(eqn):
    """'condition' where a while loop's condition reads a Ref its body writes (JAX's discharge:
    the value from before the loop, 0.7 .. 0.12.0, or an error), else 'while' where its body
    writes one (which JAX linearizes wrongly), 'checkpoint' where a differentiated
    ``jax.checkpoint`` writes one (JAX reruns it, writes included, 0.8 ..), else None."""
    if eqn.params.get('differentiated') is True and _written_refs(eqn, numbered=False):
        return 'checkpoint'   # (the param: all releases)
    if eqn.primitive.name != 'while':   # all releases
        return None
    written, cond_consts = _written_refs(eqn), eqn.invars[:eqn.params['cond_nconsts']]
    return ('condition' if any(isinstance(v, Var) and v in written for v in cond_consts)
            else 'while' if written else None)


# How JAX refuses a Ref program, by its error texts (all releases unless marked).
_REFUSALS = {
    'checkpoint': r'partial-eval of `checkpoint`',  # a write in a differentiated checkpoint, .. 0.6
    'cond': r'State effect not supported in cond partial-eval',   # a cond under reverse mode
    # vmap of a cond; checkpoint, .. 0.7; jit under differentiation, 0.4.38 (or a bare error)
    'effects': r'^NotImplementedError: $|State effect not supported|Effects not supported.*Effect\('
               r'|does not have corresponding (jaxpr )?input|JaxprInputEffect.* is invalid',
    # a per-lane value into an unbatched Ref, 0.6 ..; under jax.jacfwd, in a jit body on 0.7,
    # anywhere on 0.8 .. as a vmap or swap shape error
    'batched': r'vmapped value on an unbatched|got axis spec None but output was batched'
               r'|Invalid shape for `swap`',
    # a differentiated value into a Ref of a body differentiated whole, 0.6
    'tangent': r'differentiated value on a non-differentiated|Zero\(Ref\{',
    'while': r'Reverse-mode differentiation does not work for lax.while_loop',   # reverse mode
    'jacrev': r"Batching rule for 'freeze' not implemented",   # vmap of a Ref made in jax.vjp, 0.7
    # a write in a body under nested reverse-mode differentiation, 0.8 .. 0.10
    'transpose': r"has no attribute '?accum|'ValAccum' object has no attribute",
    # a Ref into a shard_map body: with its checks on, .. 0.5 | any, 0.9 ..
    'mapped': r"No replication rule for (get|swap)|'AbstractRef' object has no attribute",
    # a per-device value into an outer Ref in shard_map: discharged, 0.7, 0.8 | written, 0.12 ..
    'varying': r"^_RepError: |varying manual axes to match"}


def _deleted_buffer(err: BaseException) -> bool:   # a call given a deleted array (all releases)
    return isinstance(err, RuntimeError) and 'has been deleted' in str(err)


def _refusal(err: BaseException):
    said = f'{type(err).__name__}: {err}'
    return next((kind for kind, text in _REFUSALS.items() if re.search(text, said, re.S)), None)


def _unbound_axis(err: BaseException) -> bool:
    """Whether ``err`` is JAX's error for a collective over an axis name no one bound."""
    return isinstance(err, NameError) and 'axis' in str(err)


def _jaxpr_names(text: str, n_in: int, n_out: int):
    """The input and output names JAX printed, else ``#i``; the main ``{ lambda`` starts a line
    (shared sub-jaxprs may be printed before it)."""
    head = re.search(r'^\{ lambda [^;]*;(.*?)\. let', text, re.S | re.M)
    tail = re.search(r'\bin \(([^()]*)\) \}\s*$', text, re.S)
    if head and tail:
        ins = [w.split(':')[0] for w in head.group(1).split()]
        outs = [w.strip().split(':')[0] for w in tail.group(1).split(',') if w.strip()]
        if (len(ins), len(outs)) == (n_in, n_out):
            return ins, outs
    return [f'#{i}' for i in range(n_in)], [f'#{i}' for i in range(n_out)]


@functools.lru_cache(maxsize=None)
def _jit_equation():
    """A jax.jit equation to copy: its primitive ('pjit' .. 0.6, 'jit') and params vary."""
    inner = jax.jit(lambda x: x + 1)   # (not jax.make_jaxpr, which binds an axis environment)
    with jax.disable_jit(False):   # (the first ask may come under jax.disable_jit)
        jaxpr = _trace_to_jaxpr(lambda x: [inner(x)], [ShapedArray((), np.float32)], inner,
                                'jit')[0]
    return jaxpr.eqns[0]


# A jit equation lowered inline (else XLA is handed a call, which compiles slower): from 0.11
# (jax.Inline) kept in the jaxpr until lowered; before, only by copying its equations when staged.
_INLINE_LATE = getattr(getattr(jax, 'Inline', None), 'JAX_LATE', None)


def _staged(closed, name: str, whole: bool = False) -> Callable:
    """``closed`` as a function staging it as one jit equation, as a nested jax.jit is, instead
    of equation by equation (all releases: its params copied from a jax.jit's), lowered inline
    where JAX can keep the equation; ``whole``: a jit's whole program, inlined in any case."""
    eqn, n = _jit_equation(), {'in': len(closed.in_avals), 'out': len(closed.out_avals)}
    params = dict(eqn.params, jaxpr=closed, name=name, donated_invars=(False,) * n['in'],
                  inline=_INLINE_LATE or whole or eqn.params['inline'])
    for side, what in itertools.product(n, ('shardings', 'layouts')):  # as jax.jit's: one per value
        params[f'{side}_{what}'] = params[f'{side}_{what}'][:1] * n[side]
    return lambda *args: eqn.primitive.bind(*args, **params)


# A jax.jit call compiles with JAX's abstract-mesh setting at None, whose default is () on 0.4.38:
# the setting keys the compile cache, so an executable compiled ahead under () is compiled again.
_abstract_mesh = _probe('jax._src.config:abstract_mesh_context_manager')   # 0.4.38 ..
_set_abstract_mesh = _probe('jax._src.mesh:set_abstract_mesh')


# JAX's error for a NaN in a jit equation bound eagerly under jax_debug_nans, private 0.5 .. 0.11
_PrivateNanError = _probe('jax._src.api_util:InternalFloatingPointError',   # 0.6 ..
                          'jax._src.dispatch:InternalFloatingPointError') or ()   # 0.5


def _evaluated(closed) -> Callable:
    """``closed`` bound one by one, NaNs checked as jax_debug_nans says (JAX's jaxpr_as_fun
    turns it off, for the thread's later jit calls too) and raised as FloatingPointError."""
    def run(*args):
        try:
            return _src_core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
        except _PrivateNanError as err:
            raise FloatingPointError(f'invalid value ({err.ty}) encountered in {err.name}') from None
    return run


def _compile_ahead(lowered):
    """``lowered.compile()``, so that a jax.jit call on the same arguments finds the result."""
    with (_set_abstract_mesh(None) if _set_abstract_mesh and getattr(_abstract_mesh, 'value', 0)
          == () else contextlib.nullcontext()):
        return lowered.compile()


def _bind(eqn, values) -> list:
    """``eqn``'s outputs at ``values``, evaluated as JAX's evaluator does (``get_bind_params``)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)   # (subfuns, params) .. 0.8
    outs = eqn.primitive.bind(*subfuns, *values, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def _type_mesh(aval):
    """The mesh in ``aval``'s type (0.5 ..), else None: jax.jit traces anew for a new one."""
    mesh = getattr(getattr(aval, 'sharding', None), 'mesh', None)
    return None if mesh is None or mesh.empty else mesh


def _explicit(sharding) -> bool:
    """Whether ``sharding``'s mesh has explicit axes: a sharding in a value's type (0.5 ..)."""
    return _AXIS_EXPLICIT in getattr(getattr(sharding, 'mesh', None), 'axis_types', ())


def _laid_out(value, sharding):
    """``value`` given ``sharding``: placed there if concrete (jax.disable_jit), else ``reshard``
    on a mesh of explicit axes (0.5 ..), which refuses a mere constraint, or a constraint."""
    if not isinstance(value, Tracer):   # (run eagerly: under jax.disable_jit)
        return jax.device_put(value, sharding)
    return (_reshard if _explicit(sharding) else jax.lax.with_sharding_constraint)(value, sharding)


def _lane_key_layout(batched):
    """The layout per-lane keys take along axis 0: that of the first of ``batched`` ((value,
    axis) pairs) whose axis lies on explicit mesh axes, which JAX maps with no unsharded one."""
    for value, axis in batched:
        sharding = getattr(_aval_of(value), 'sharding', None)
        if axis is not None and _explicit(sharding) and (on := sharding.spec[axis]) is not None:
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(on))
    return None


def _batched_flags(fun, avals, in_axes, axis_name, size) -> list:
    """Whether each output of ``jax.vmap(fun, in_axes)`` varies across lanes: a custom_vmap
    identity's rule sees how JAX batches its operands (under jax.eval_shape: nothing runs)."""
    seen, identity = [], jax.custom_batching.custom_vmap(lambda *xs: xs)

    @identity.def_vmap
    def rule(axis_size, batched, *xs):
        seen.extend(batched)
        return xs, tuple(batched)
    jax.eval_shape(jax.vmap(lambda *xs: identity(*fun(*xs)), in_axes=in_axes,
                            axis_name=axis_name, axis_size=size), *avals)
    return seen


def _jax_export():
    """``jax.export``, or an ImportError naming what it needs beyond JAX (flatbuffers, absl-py)."""
    try:
        from jax import export as module
        missing = None if importlib.util.find_spec('flatbuffers') else 'flatbuffers'
    except ImportError as err:
        missing = {'absl': 'absl-py', 'flatbuffers': 'flatbuffers'}.get(str(err.name).split('.')[0])
        if missing is None:
            raise
    if missing:
        raise ImportError(f'exporting needs the {missing!r} package, which jax.export uses '
                          f'on JAX {jax.__version__}: pip install {missing}')
    return module


# jax.export serializes a pytree node type only once registered (all releases): its registry
# (probed once jax.export is imported) maps a type to (serialized name, ...); its refusal
# names the type (serializing) or the serialized name (loading).
_EXPORT_REGISTRY = 'jax._src.export._export:serialization_registry'


def _unregistered_type(err):
    """The match of jax.export's refusal of a pytree type it has no serialization for, or None."""
    return re.search(r'unregistered type `([^`]*)`', str(err))


def _key_impl_name(key) -> str:   # key_impl: a PRNGSpec for an impl not registered by name
    spec = jax.random.key_impl(key)
    return spec if isinstance(spec, str) else spec._impl.name


# =============================================================================
# 2. Errors and small helpers
#
# The two errors users catch, and helpers later sections lean on: where user code calls from, a
# value's signature (the unit of every cache key), whether a value spans several devices.
# =============================================================================

_leaves = jax.tree_util.tree_leaves


class TraceContextError(RuntimeError):
    """A traced value would escape the JAX trace it belongs to.

    Raised when a value is written into a :class:`State` where no enclosing stateful trace can
    thread it out (for example inside a plain ``jax.jit``, or per-lane inside a ``jax.vmap`` nested
    in a stateful function), and when a State that kept a tracer from a finished trace is read.

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

    Raised by :class:`StatefulMapping` with ``unexpected_out_state_mapping='raise'`` when a state
    that came in unbatched is written with a batched value.
    """


_LIBRARY_END = sys.maxsize   # the first line of this file's user code (the demo's: section 12)


def _outside(skip_jax: bool):
    """``(frame, level)`` of the first caller outside this module's library code (and JAX)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (
            frame.f_code.co_filename == __file__ and frame.f_code.co_firstlineno < _LIBRARY_END
            or skip_jax and frame.f_code.co_filename.startswith(os.path.dirname(jax.__file__))):
        frame, level = frame.f_back, level + 1
    return frame, level


def _user_site():
    frame = _outside(skip_jax=False)[0]
    return frame and (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def _who(sf) -> str:
    """``StatefulFunction('f')``: how errors name a function."""
    return f'{_public_class(sf)}({sf.name!r})'


def _public_class(obj) -> str:
    """The name of ``obj``'s first public class: a private subclass speaks as its parent."""
    return next(c.__name__ for c in type(obj).__mro__ if not c.__name__.startswith('_'))


def _name_of(fun) -> str:
    return getattr(fun, '__name__', type(fun).__name__)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _format_site(site) -> str:
    return 'an unknown place' if site is None else '{}:{} (in {})'.format(*site)


def _aval_of(x):
    return _typeof(x) if (aval := getattr(x, 'aval', None)) is None else aval


def _leaf_sig(x) -> tuple:
    return _aval_sig(_aval_of(x))


def _aval_sig(aval) -> tuple:
    """``(shape, dtype, weak_type, spec, mesh)``, the unit of every cache key: equal for an array
    and a tracer of its type, which avals (carrying sharding) may not be; ``spec``: the
    partitioning over explicit mesh axes, else None; ``mesh``: its mesh; both part of the type."""
    sharding = getattr(aval, 'sharding', None)
    return (aval.shape, aval.dtype, aval.weak_type,
            sharding.spec if _explicit(sharding) else None, _type_mesh(aval))


def _value_sig(value) -> tuple:
    """Structure and leaf signatures of a state value (what makes a trace stale)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, tuple(map(_leaf_sig, leaves))


def _stale_sig(value, sig, exact: bool = False):
    """``value``'s signature where it is not ``sig``, else None; a weak type or a mesh counts only
    when ``exact`` (reusing a trace: code there may see either, as in an argument's)."""
    try:
        got = _value_sig(value)
    except TypeError:
        return 'not a pytree of arrays'
    same = got == sig or (not exact and got[0] == sig[0]
                          and all(a[:2] + a[3:4] == b[:2] + b[3:4]
                                  for a, b in zip(got[1], sig[1], strict=True)))
    return None if same else got


def _contains_tracer(tree) -> bool:
    return any(isinstance(x, Tracer) for x in _leaves(tree))


# Bumped when a State outside any trace gets or loses a multi-device value, or a call gives it a
# new layout: jax.jit retraces on new shapes, not on new shardings, so the dispatcher's static key
# (``_layout_token``) must see it.
_layout_epoch = 0


def _multi_device(leaf):   # (a layout to keep, one jax.jit takes)
    sharding = None if isinstance(leaf, Tracer) else getattr(leaf, 'sharding', None)
    return sharding if sharding is not None and len(sharding.device_set) > 1 and _jit_takes(
        sharding) else None


# =============================================================================
# 3. States and the state trace stack
#
# Outside a stateful trace ``State.value`` is a plain attribute; inside, reads and writes go to the
# thread's innermost stacks through section 6's ``_touch_all`` / ``_traced_write``.
# =============================================================================

# StateTraceStacks open in all threads: while none is, a call skips the thread-local lookup.
# One item per open stack: list.append and list.pop are atomic, so it needs no lock.
_frames_open = []


class _Context(threading.local):
    def __init__(self):
        self.frames: list = []         # active StateTraceStacks, outermost first
        self.catchers: list = []       # active catch_new_states collectors
        self.check_tree = False        # inside check_state_value_tree(True)
        self.ntraces: int = 0          # user-function traces run by this thread
        self.shared_epoch = False      # inside a run binding the shared epoch
        self.doors: list = []          # the _Doors this thread is in, outermost first


_ctx, _MISSING = _Context(), object()
_Broken = collections.namedtuple('_Broken', 'error message shown')   # a State's lost value


def _innermost_overlay(frames):
    return next((frame for frame in reversed(frames) if frame._overlays), None)


def _slot(state, slot: str):
    """A side slot of ``state`` as the innermost stack that wrote it sees it."""
    entries = (frame._side.get((id(state), slot)) for frame in reversed(_ctx.frames))
    return next((entry[2] for entry in entries if entry is not None), getattr(state, slot))


def _set_slot(state, slot: str, value) -> None:
    if (frame := _innermost_overlay(_ctx.frames)) is not None:
        frame._side[id(state), slot] = (state, slot, value)   # see StateTraceStack.__exit__
        return
    _check_tracers_may_enter(state, value, (), slot)
    setattr(state, slot, value)


def _slot_property(slot: str, doc: str, settable: bool = True) -> property:
    return property(lambda self: _slot(self, slot),
                    (lambda self, v: _set_slot(self, slot, v)) if settable else None, doc=doc)


def _check_tracers_may_enter(state, value, traces, slot: str = '_value') -> None:
    """Refuses a tracer that would outlive its trace in ``state``'s value or side ``slot``: one
    from neither the trace that made ``state`` nor ``traces`` (the stateful ones around)."""
    if all(not isinstance(leaf, Tracer) or (trace := _tracer_trace(leaf)) is state._creation_trace
           or trace in traces for leaf in _leaves(value)):
        return
    if slot != '_value':
        fix = ('call restore_key() inside the traced function that backed it up (a nested '
               'StatefulFunction or checkpoint one too), or backup_key() outside that function'
               if slot == '_backup' else 'give it a concrete value')
        problem = f'would keep a tracer in its {slot[1:]} after the trace that made it; {fix}'
    elif traces:
        problem = ('was assigned a traced value in a JAX transformation (lax.scan, lax.cond, an '
                   'inner jax.jit, jax.grad ...) nested in the stateful function that created it: '
                   'no enclosing trace can thread it out.  Create the State outside the function, '
                   'or return the value from the transformation and assign it outside')
    elif type(_innermost_overlay(_ctx.frames)) is _EagerCall:
        problem = ('was assigned a traced value in a JAX transformation (jax.grad, jax.vmap ...) '
                   'in a stateful function run eagerly under jax.disable_jit(), which it would '
                   'outlive: call the function compiled, or return the value and assign it outside')
    else:
        problem = ('was assigned a JAX tracer outside any stateful trace (e.g. in a plain '
                   'jax.jit, jax.grad or jax.vmap), which it would outlive.  Wrap the outer '
                   'function in StatefulFunction (or StatefulMapping) to thread State updates, '
                   'or thread the values explicitly with StatefulFunction.jaxpr_call()')
    raise TraceContextError(f'{state._describe()} {problem}')


# -- The door: every read-modify-write of State values outside a trace -----------------------
# Compiled and eager calls, key draws and assignments are doors, taking their locks all or none
# so that no two wait for each other.  A host callback, run inside its call, may read what it holds.
_state_locks = weakref.WeakKeyDictionary()   # State -> its lock (a copy gets its own)


def _state_lock(state):
    return _state_locks.setdefault(state, threading.Lock())   # one atomic dict step


class _Door:
    """A door (a function changing States) that a thread is in, on its ``_ctx.doors`` from taking
    its locks to releasing them: ``locks`` held for ``who`` (a function; None: this module's own
    step, in which an assignment may nest); ``strict``: see ``_dispatch_body``.  ``with`` pushes
    it, then pops it and releases the locks (as assignments and warm calls do inline)."""
    __slots__ = ('who', 'locks', 'strict')

    def __init__(self, who, locks, strict: bool = False):
        self.who, self.locks, self.strict = who, locks, strict

    def __enter__(self):
        _ctx.doors.append(self)
        return self

    def __exit__(self, *exc):
        _ctx.doors.pop()
        for lock in self.locks:
            lock.release()


_waiting, _waiting_lock = {}, threading.Lock()   # thread -> the lock it waits for, those it holds


def _hold(who, states, locks, writes) -> tuple:
    """Takes ``locks`` (those of ``states`` sorted by id) all or none for the door calling it,
    waiting with none held; returns those taken.  One this thread holds is skipped: a callback
    may read what its call holds, but not change ``writes``."""
    mine = None
    while True:
        for k, lock in enumerate(locks):
            if not lock.acquire(False):
                break
        else:
            return locks
        for taken in locks[:k]:
            taken.release()
        if mine is None:
            mine = {lock: door.who for door in _ctx.doors for lock in door.locks}
            actor = 'an assignment or key draw' if who is None else _who(who)
            of = dict(zip(locks, sorted(states, key=id), strict=True))
            for lock, state in of.items():
                if mine.get(lock) is not None and state in writes:
                    raise RuntimeError(
                        f'{actor} would change {state._describe()} in a host callback of the '
                        f'running call of {_who(mine[lock])}, which holds it: its write-back would '
                        'lose the change (or hand a key out twice).  Return the value from the '
                        'callback instead')
            locks = tuple(lock for lock in locks if lock not in mine)
            continue
        me = threading.get_ident()
        with _waiting_lock:   # waiting with locks held (a callback): never in a ring of such waits
            wanted, ring = lock, set()
            while mine and wanted not in mine:
                holder = next((t for t, (_, held) in _waiting.items() if wanted in held), None)
                if holder is None or holder in ring:
                    break
                ring.add(holder)
                wanted = _waiting[holder][0]
            if mine and wanted in mine:
                raise RuntimeError(
                    f'{actor} in a host callback would wait for {of[lock]._describe()}, which '
                    'another call holds while its own callback waits for one this call holds.  '
                    'Return the value from the callback and assign it after the call')
            if mine:
                _waiting[me] = lock, set(mine)
            elif _on_xla_thread():   # (a wait for the call it serves would never end)
                raise RuntimeError(
                    f'{actor} in a host callback JAX runs on a thread of its own would wait for '
                    f'{of[lock]._describe()}, which a running call holds, maybe its own.  Return '
                    'the value from the callback and assign it after the call')
        try:
            lock.acquire()
            lock.release()
        finally:
            _waiting.pop(me, None)


def _atomic(step):
    """``step(state, ...)`` as the door for the State's read-modify-write, one step for other
    threads (in a trace, the call running it holds the lock); an assignment to it nests."""
    @functools.wraps(step)
    def door(state, *args, **kwargs):
        locks = () if _frames_open and _innermost_overlay(_ctx.frames) else (_state_lock(state),)
        (doors := _ctx.doors).append(_Door(None, _hold(None, (state,), locks, (state,))))
        try:
            return step(state, *args, **kwargs)
        finally:
            for lock in doors.pop().locks:
                lock.release()
    return door


@_atomic
def _store(state, value) -> None:
    _store_all([(state, value)])


def _store_all(pairs) -> None:
    """Stores each ``(state, value)``, all or none: whether a layout changes (``_layout_epoch``)
    is found for all first, as flattening a value may fail."""
    global _layout_epoch
    _layout_epoch += any(map(_multi_device, _leaves([(v, s._value) for s, v in pairs])))
    for state, value in pairs:
        state._value, state._broken = value, None


_BAKED_STATES = weakref.WeakSet()   # States read under a plain JAX trace (outside stateful traces)


def _baked(state):
    """``state``'s own value, noting a plain JAX trace reading it (a jaxpr JAX may cache)."""
    if _under_jax_trace():
        _BAKED_STATES.add(state)
    return state._value


class State:
    """A mutable container for a pytree of arrays.

    While a :class:`StatefulFunction` traces, reading ``value`` records a read and assigning
    records a write; otherwise it is a plain attribute.  ``name`` labels reprs, jaxprs and
    errors; ``metadata`` is free-form (string filters match its ``tag``).

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
        self._name, self._metadata, self._source = name, metadata, _user_site()
        self._check_value(value)
        self._value, self._broken = value, None   # _broken: a _Broken while nothing is readable
        self._stack_level, self._creation_trace = len(_ctx.frames), _current_trace()
        self._owner = _innermost_overlay(_ctx.frames)   # the overlay it lives in, if any
        if self._owner is not None:
            self._owner._owned.append(self)
        for catcher in _ctx.catchers:
            catcher.append(self)

    @property
    def value(self):
        """The current value; reads and writes are recorded while tracing."""
        if frames := _ctx.frames:
            return _view(self, *_touch_all(self, frames, write=False))
        if self._broken is not None:
            self._raise_broken()
        return _baked(self)

    @value.setter
    def value(self, v):
        self._assign(v, written=True)

    def restore_value(self, v) -> None:
        """Sets a value of the same pytree structure without recording a write (a read is)."""
        self._assign(v, written=False)

    def _assign(self, v, written: bool) -> None:
        self._refuse(v, written)
        if frames := _ctx.frames:
            _traced_write(self, v, frames, written=written)
        else:
            _store(self, v)

    def _refuse(self, v, written: bool) -> None:
        """Raises where ``v`` may not be assigned (so that a group checks all before writing)."""
        self._check_value(v)
        if _ctx.check_tree or not written:
            frame = _innermost_overlay(_ctx.frames)
            cur = self._value if frame is None else frame._values.get(id(self), self._value)
            old = cur.treedef if type(cur) is _RefCell else jax.tree_util.tree_structure(cur)
            if old != (new := jax.tree_util.tree_structure(v)):
                raise ValueError(
                    f'the pytree structure of {self._describe()} would change from {old} to '
                    f'{new} ' + ('inside check_state_value_tree(); assign a value with the same '
                                 'structure or leave the check_state_value_tree() block' if written
                                 else 'in restore_value(); assign a new structure to .value'))
        if not _ctx.frames:
            _check_tracers_may_enter(self, v, ())

    def _check_value(self, v) -> None:
        """Refuses a value no State may hold (subclasses restrict values further)."""
        if not isinstance(v, Tracer):   # (the common value while tracing, and a leaf)
            for leaf in _leaves(v):
                if isinstance(leaf, State):
                    raise ValueError(
                        f'{self._describe()} cannot hold another State ({leaf._describe()}); '
                        'use its value: State(other.value), target.value = other.value')
                if type(leaf) is int and not -2 ** 31 <= leaf < 2 ** 31:
                    info = np.iinfo(jax.dtypes.canonicalize_dtype(int))
                    if not info.min <= leaf <= info.max:
                        raise OverflowError(
                            f'{self._describe()}: the Python int {leaf} does not fit in '
                            f"{info.dtype} (JAX's integer type here); pass it as a float, or as "
                            'an array of an explicit wider dtype with jax_enable_x64 on')

    def _label(self) -> str:
        return self._name or type(self).__name__

    def _raise_broken(self):
        raise self._broken.error(self._broken.message)

    name = _slot_property('_name', 'The name given at creation (or ``None``).')
    metadata = _slot_property('_metadata', 'Free-form metadata given at creation.', False)
    stack_level = _slot_property('_stack_level', 'Depth of the state trace stack at creation.')
    tag = property(lambda self: self.metadata.get('tag'),
                   lambda self, tag: _set_slot(self, '_metadata', {**self.metadata, 'tag': tag}),
                   doc='The ``tag`` metadata entry (``None`` when absent).')

    def increase_stack_level(self) -> None:
        """Adds one to :attr:`stack_level`."""
        self.stack_level += 1

    def decrease_stack_level(self) -> None:
        """Subtracts one from :attr:`stack_level` (not below 0)."""
        self.stack_level = max(self.stack_level - 1, 0)

    source_info = property(lambda self: _format_site(self._source),
                           doc='Where this State was created, as ``file:line (in function)``.')

    def _describe(self) -> str:
        label = f"{type(self).__name__} {self._name!r}" if self._name else type(self).__name__
        return f'{label} created at {self.source_info}'

    def raise_error_with_source_info(self, error: BaseException):
        """Raises ``error`` (as its type, if it can) with this State's creation site attached."""
        message = f'{error} [{self._describe()}]'
        try:
            new = type(error)(message)
        except Exception:  # exceptions with unusual constructors
            new = RuntimeError(message)
        raise new from error

    def copy(self) -> 'State':
        """A new State of the same class with the same value and metadata."""
        return self.replace()

    def __copy__(self) -> 'State':
        new = self.replace()   # copy.copy keeps the creation site and stack level too
        new._source, new._stack_level = self._source, self.stack_level
        return new

    def replace(self, value=_MISSING, **metadata) -> 'State':
        """A new State of this class holding ``value`` (default: the current one)
        and this State's metadata updated by ``metadata``; a State ``value`` of
        this class is returned, ``replace``-d with ``metadata`` if given."""
        if isinstance(value, State):
            if type(value) is not type(self):
                raise ValueError(
                    f'{self._describe()}.replace() got a {type(value).__name__} as the value; '
                    f'pass a {type(self).__name__} or a plain value')
            return value.replace(**metadata) if metadata else value
        metadata = {**self.metadata, **metadata}   # (``name`` too: the new State's)
        new = _new_state(type(self), self.value if value is _MISSING else value,
                         metadata.pop('name', self.name), metadata)
        vars(new).update(vars(self))   # what a subclass set on itself
        return new

    def to_state_ref(self) -> 'TreefyState':
        """A pytree snapshot of this State: its class, value and metadata."""
        return TreefyState(type(self), self.value, _name=self.name, **self.metadata)

    def update_from_ref(self, state_ref: 'TreefyState') -> None:
        """Takes value (as a write) and metadata from a :meth:`to_state_ref` snapshot."""
        metadata = state_ref.get_metadata()
        self.value, self.name = state_ref.value, metadata.pop('_name', self.name)
        _set_slot(self, '_metadata', {**self.metadata, **metadata})

    def value_call(self, func: Callable):
        """``jax.tree.map(func, self.value)``."""
        return jax.tree_util.tree_map(func, self.value)

    def check_if_deleted(self) -> None:
        """Raises ``ValueError`` if a leaf's buffer was deleted (e.g. donated); ``RuntimeError``
        if a donating call that deleted it then failed."""
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

    def __hash__(self):   # (equality is object's: by identity)
        return hash(id(self))

    def __repr__(self):
        shown = f'<{self._broken.shown}>' if self._broken is not None else repr(self._value)
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
    """A State's class, value and metadata (:meth:`State.to_state_ref`); the value is its leaf.

    Example
    -------
    >>> ref = State(jnp.ones(2), name='w').to_state_ref()
    >>> jax.tree_util.tree_leaves(ref)
    [Array([1., 1.], dtype=float32)]
    >>> ref.to_state().name
    'w'
    """

    def __init__(self, type: type, value, **metadata):
        if not (inspect.isclass(type) and issubclass(type, State)):
            raise TypeError(f'TreefyState(type, value) needs a State class, got {type!r}')
        self.type, self.value = type, value
        vars(self).update(metadata)

    name = property(lambda self: vars(self).get('_name'), doc="The State's name.")

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
    lambda aux, children: TreefyState(aux[0], children[0], **dict(aux[1])))


class ShortTermState(State):
    """A State whose value is transient (e.g. the last input or spike)."""


class LongTermState(State):
    """A State whose value persists across steps (e.g. running statistics)."""


class ParamState(LongTermState):
    """A trainable parameter."""


class BatchState(LongTermState):
    """A State holding per-batch statistics."""


class HiddenState(ShortTermState):
    """A recurrent hidden state; its value must be a single array.

    Example
    -------
    >>> h = HiddenState(jnp.zeros(4))
    """

    def _check_value(self, v):
        super()._check_value(v)
        if not isinstance(v, (jax.Array, Tracer, np.ndarray, np.generic, int, float, complex)):
            raise ValueError(f'{self._describe()} holds a single array, got '
                             f'{type(v).__name__}; use State for pytree values')


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple:
    with jax.ensure_compile_time_eval():   # (the first ask may come inside a trace)
        return jax.random.key_data(jax.random.key(0, impl=impl)).shape


def _is_typed_key(x) -> bool:
    return hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _make_key(seed_or_key, owner: str):
    """The key a RandomState holds for a seed (int, integer array or None: a random one); any
    other ``seed_or_key`` as given, for RandomState._check_value.  ``owner`` names it in errors."""
    seed_or_key = _pyrandom.randrange(2 ** 31) if seed_or_key is None else seed_or_key
    if _is_int(seed_or_key):
        if not -2 ** 63 <= seed_or_key < 2 ** 63:
            raise OverflowError(f'{owner}: the seed {seed_or_key} does not fit in 64 bits; '
                                'pass a seed in [-2**63, 2**63), e.g. seed % 2**63')
        return jax.random.PRNGKey(int(seed_or_key))
    if (isinstance(seed_or_key, (Tracer, jax.Array, np.ndarray)) and np.size(seed_or_key) == 1
            and jnp.issubdtype(seed_or_key.dtype, jnp.integer)):   # (a key's dtype is not)
        return jax.random.PRNGKey(jnp.reshape(seed_or_key, ()))
    return seed_or_key


def _check_n(owner, method: str, n, fix: str) -> None:
    if not _is_int(n) or not 0 < n < 2**31:
        raise ValueError(f'{owner._describe()}: {method}(n) needs an int n >= 1 (below 2**31), '
                         f'got {n!r}; {fix}')


class RandomState(State):
    """A State holding a PRNG key, split and advanced as you draw.

    ``seed_or_key``: an int (held as ``PRNGKey(seed)``), a raw or typed key, or ``None`` (random).

    Example
    -------
    >>> rng = RandomState(0)
    >>> noise = jax.random.normal(rng.split_key(), (3,))
    >>> keys = rng.split_key(4)    # 4 independent keys
    """
    _backup = None   # the key saved by backup_key(): a side slot (see _slot)

    def __init__(self, seed_or_key=None, name: str | None = None, **metadata):
        owner = f'{type(self).__name__}(name={name!r}) created at {_format_site(_user_site())}'
        super().__init__(_make_key(seed_or_key, owner), name, **metadata)

    def _check_value(self, v):
        super()._check_value(v)
        shape = _raw_key_shape(jax.config.jax_default_prng_impl)
        raw_key = getattr(v, 'dtype', None) == np.uint32 and np.shape(v)[-len(shape):] == shape
        if not (_is_typed_key(v) or raw_key):
            raw = ', '.join(map(str, shape))
            shown = f' {getattr(v, "dtype", "")}{list(np.shape(v))}' if hasattr(v, 'shape') else ''
            raise ValueError(
                f'{self._describe()} holds a PRNG key (raw uint32[..., {raw}] or typed), got '
                f'{type(v).__name__}{shown}; give it a raw uint32[{raw}] key (jax.random.PRNGKey) '
                'or a typed key (jax.random.key), or seed it with an int seed or None')

    def seed(self, seed_or_key=None) -> None:
        """Resets the key: ``PRNGKey(int)``, a given key, or a fresh random one."""
        self.value = _make_key(seed_or_key, f'{self._describe()}.seed')

    def set_key(self, key) -> None:
        """Assigns ``key`` as the new key."""
        self.value = key

    @_atomic
    def split_key(self, n: int | None = None, backup: bool = False):
        """Advances the state; returns one new key, or ``n`` keys stacked.
        With ``backup=True`` the advanced key is also saved (:meth:`backup_key`)."""
        if n is not None:
            _check_n(self, 'split_key', n, 'call split_key() for a single key')
        keys = jax.random.split(self.value, 2 if n is None else int(n) + 1)
        self.value = keys[0]
        if backup:
            self.backup_key()
        return keys[1] if n is None else keys[1:]

    @_atomic
    def self_assign_multi_keys(self, n: int, backup: bool = True) -> None:
        """Replaces the key by ``n`` keys split from it (one per lane); with
        ``backup`` it first advances and saves its key for :meth:`restore_key`."""
        _check_n(self, 'self_assign_multi_keys', n, 'pass the number of keys wanted')
        self.value = self.split_key(n, True) if backup else jax.random.split(self.value, int(n))

    @_atomic
    def backup_key(self) -> None:
        """Remembers the current key so that :meth:`restore_key` can return to it."""
        if _slot(self, '_backup') is not None:
            raise ValueError(f'{self._describe()}: backup_key() called twice without '
                             'restore_key(); restore the saved key first')
        _set_slot(self, '_backup', self.value)

    @_atomic
    def restore_key(self) -> None:
        """Sets the key saved by :meth:`backup_key` (and forgets the backup); in a traced
        function, one saved there (a compiled call would keep one saved outside as a constant)."""
        if (backup := _slot(self, '_backup')) is None:
            raise ValueError(f'{self._describe()}: restore_key() without a backup_key(); '
                             'call backup_key() first')
        if type(_innermost_overlay(_ctx.frames)) is _TraceFrame and not any(
                (id(self), '_backup') in frame._side for frame in _ctx.frames):
            raise TraceContextError(
                f'{self._describe()}: restore_key() in a traced function restores a key backed '
                'up outside it, which every later call of the compiled function would restore '
                'again; call restore_key() before the function, or backup_key() inside it too')
        self.value = backup
        _set_slot(self, '_backup', None)

    def clone(self) -> 'RandomState':
        """A new, independent RandomState seeded from a key split off this one."""
        return type(self)(self.split_key(), self.name, **self.metadata)


class StateTraceStack:
    """Records which States a piece of code touches, in first-touch order.

    A context manager; stacks nest LIFO, per thread, and an enclosing stack also records what a
    nested one does.  With ``new_arg``, ``new_arg(state)`` at a state's first touch gives what code
    inside sees, and values assigned inside stay in the stack (an overlay), not in the States.
    ``name`` labels errors; names, return types and ``been_writen`` follow brainstate 0.2.1.

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
        self.states, self.been_writen, self._originals, self._index = [], [], [], {}
        self._overlays, self._values, self._side, self._owned = False, {}, {}, []
        if new_arg is not None:
            if not callable(new_arg):
                raise TypeError(f'StateTraceStack(new_arg, name) got new_arg={new_arg!r}, not a '
                                f'callable; to name the stack pass name={new_arg!r} by keyword')
            self.set_new_arg(new_arg)

    def set_new_arg(self, new_arg: Callable) -> None:
        """Makes this stack lift states through ``new_arg(state)`` (see class doc)."""
        self._new_arg, self._overlays = new_arg, True

    def _lift(self, state, current):   # (a _TraceFrame also needs ``current``)
        self._values[id(state)] = current   # what new_arg sees, should it read the State
        return self._new_arg(state)

    def new_arg(self, state: State) -> None:
        """Lifts ``state`` through the ``new_arg`` function now (no-op without one)."""
        if self._overlays:
            self._values[id(state)] = self._lift(state, state._value)

    def _touch(self, state, current, write: bool):
        if (index := self._index.get(id(state))) is None:
            self._index[id(state)] = len(self.states)
            self.states.append(state)
            self.been_writen.append(write)
            self._originals.append(current)
            if self._overlays:
                self._values[id(state)] = self._lift(state, current)
        elif write:
            self.been_writen[index] = True
        return self._values[id(state)] if self._overlays else current

    def _attempt(self, run: Callable):
        """``run()``; should it raise, what it wrote in this overlay (values, side slots, marks)
        is undone, as a failed nested call writes nothing."""
        values, side, written = dict(self._values), dict(self._side), list(self.been_writen)
        try:
            return run()
        except BaseException:
            self._values = {**dict(zip(map(id, self.states), self._originals)), **values}
            self._side, self.been_writen[:] = side, written + [False] * (
                len(self.been_writen) - len(written))
            raise

    def read_its_value(self, state: State) -> None:
        """Records a read of ``state``."""
        self._touch(state, state._value, False)

    def write_its_value(self, state: State) -> None:
        """Records a write of ``state``."""
        self._touch(state, state._value, True)

    def __enter__(self):
        _frames_open.append(None)
        _ctx.frames.append(self)
        return self

    def __exit__(self, exc_type, *exc):
        """Leaves the stack (LIFO); without an error, hands on the side slots written inside."""
        if self in (frames := _ctx.frames):
            _frames_open.pop()
        if not frames or frames[-1] is not self:
            if self in frames:
                frames.remove(self)
            raise RuntimeError(f'StateTraceStack {self.name!r} exited out of order: exit trace '
                               'stacks in the reverse order they were entered (nested `with`)')
        frames.pop()
        try:
            if exc_type is None:   # (tracers of States made inside are dropped)
                self._hand_on([e for e in self._side.values()
                               if not (e[0]._owner is self and _contains_tracer(e[2]))])
        finally:
            self._close()

    def _hand_on(self, entries) -> None:
        traces = tuple(f._jax_trace for f in _ctx.frames)
        for state, slot, value in entries:
            _check_tracers_may_enter(state, value, traces, slot)
        for entry in entries:
            _set_slot(*entry)

    def _close(self):
        """Ends an overlay (see _release)."""
        _release(self._owned)
        self._owned, self._values, self._side = [], {}, {}

    original_state_values = property(lambda self: tuple(self._originals), doc="Each recorded "
                                     "state's value when this stack first saw it.")

    def get_read_states(self, replace_writen: bool = False) -> tuple:
        """States only read (written ones are ``None`` with ``replace_writen``)."""
        return tuple(None if w else s for s, w in zip(self.states, self.been_writen, strict=True)
                     if replace_writen or not w)

    def get_write_states(self, replace_read: bool = False) -> tuple:
        """States written (read-only ones are ``None`` with ``replace_read``)."""
        return tuple(s if w else None for s, w in zip(self.states, self.been_writen, strict=True)
                     if replace_read or w)

    def get_state_values(self, separate: bool = False, replace: bool = False) -> tuple:
        """The recorded states' current values; with ``separate``, a pair (the written states'
        values, the read ones'), where ``replace`` puts ``None`` for the others in each."""
        return ((self.get_write_state_values(replace), self.get_read_state_values(replace))
                if separate else tuple(s.value for s in self.states))

    def get_read_state_values(self, replace_writen: bool = False) -> tuple:
        """Values of :meth:`get_read_states`."""
        return tuple(None if s is None else s.value for s in self.get_read_states(replace_writen))

    def get_write_state_values(self, replace_read: bool = False) -> tuple:
        """Values of :meth:`get_write_states`."""
        return tuple(None if s is None else s.value for s in self.get_write_states(replace_read))

    def state_subset(self, state_type: type) -> list:
        """The recorded states that are instances of ``state_type``."""
        return [s for s in self.states if isinstance(s, state_type)]

    def recovery_original_values(self) -> None:
        """Gives every recorded state back the value it had when first touched."""
        for state, original in zip(self.states, self._originals, strict=True):
            if (original is not None and type(original) is not _RefCell
                    and not _contains_tracer(original)):
                state.restore_value(original)

    def assign_state_vals(self, state_vals: Sequence) -> None:
        """Assigns one value per state: by ``value`` if written, else by ``restore_value``."""
        self.assign_state_vals_v2(state_vals, state_vals)

    def assign_state_vals_v2(self, read_state_vals: Sequence, write_state_vals: Sequence) -> None:
        """Like :meth:`assign_state_vals` with separate read and write lists
        (each as long as :attr:`states`, as from ``get_state_values(True, True)``)."""
        if (got := (len(read_state_vals), len(write_state_vals))) != (len(self.states),) * 2:
            raise ValueError(f'State length mismatch: expected {len(self.states)} read and '
                             f'write values, got {got[0]} and {got[1]}')
        pairs = [(state, wv if written else rv, written) for state, rv, wv, written in zip(
            self.states, read_state_vals, write_state_vals, self.been_writen, strict=True)]
        for pair in pairs:   # (all refused or none: each checked before any is written)
            pair[0]._refuse(*pair[1:])
        for state, value, written in pairs:
            state._assign(value, written)

    def merge(self, *others: 'StateTraceStack') -> 'StateTraceStack':
        """Adds the states of ``others`` to this stack (writes OR-ed); returns ``self``."""
        for stack in others:
            for touched in zip(stack.states, stack._originals, stack.been_writen, strict=True):
                self._touch(*touched)
        return self

    def __add__(self, other: 'StateTraceStack') -> 'StateTraceStack':
        """A new stack holding the states of both."""
        return StateTraceStack().merge(self, other)

    def __repr__(self):
        rows = ', '.join(f'{s._label()}:{"w" if w else "r"}'
                         for s, w in zip(self.states, self.been_writen, strict=True))
        return f'StateTraceStack(name={self.name!r}, states=[{rows}])'


def _release(states) -> None:
    """Ends the ownership of ``states`` made inside a finished trace: those that kept a tracer
    keep only its shape."""
    for state in states:
        state._owner = None
        if _contains_tracer(state._value):
            state._value = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, Tracer)
                else x, state._value)
            state._broken = _Broken(
                TraceContextError, f'{state._describe()} holds a tracer from the finished '
                'trace that created it; return its value from the traced function, or create '
                'the State outside it', 'tracer from a finished trace')


@contextlib.contextmanager
def check_state_value_tree(val: bool = True):
    """Inside this block, assigning a value whose pytree structure differs from a State's current
    one raises ``ValueError`` (``val=False`` turns the check off inside an enclosing block).

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


def _reject_states(tree, what: str, refuse: Callable | None = None) -> None:
    """Refuses a State among ``tree``'s leaves (``what`` names ``tree``; ending in a space, it is
    a verb, as 'returned '); with ``refuse``, then a leaf JAX cannot take: raises
    ``refuse(error, keystr, leaf)``, the error JAX gave made plain."""
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in pairs:
        if isinstance(leaf, State):
            verb = not path and what.endswith(' ')
            where = what.rstrip() if verb else f'{what}{jax.tree_util.keystr(path)} is'
            raise ValueError(f'{where} a State ({leaf._describe()}); return or pass its '
                             'value instead (state.value)')
    for path, leaf in pairs if refuse is not None else ():
        try:
            _leaf_sig(leaf)
        except (TypeError, OverflowError) as err:
            raise refuse(err, jax.tree_util.keystr(path), leaf) from None


def _refuse_non_jax(state, value, name: str) -> None:
    """Refuses ``value``, assigned to ``state`` in the stateful function ``name``, unless JAX's."""
    if not all(isinstance(x, (Tracer, jax.Array)) for x in _leaves(value)):   # (else checked)
        _reject_states(value, '', lambda err, path, leaf: TypeError(
            f'{state._describe()} was assigned {leaf!r} (a {type(leaf).__name__})'
            + (f' at value{path}' if path else '') + f' in the stateful function {name!r}, which '
            'is not a JAX type; assign arrays, scalars or pytrees of them'))


# =============================================================================
# 4. State filters
#
# A filter picks states (``state_in_axes``, ``donate_states``, ...); see to_predicate.
# =============================================================================

class _Filter:
    """A predicate ``f(path, state) -> bool`` compared, hashed and shown by its arguments."""

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self), *vars(self).values()))

    def __repr__(self):
        args = [a for v in vars(self).values() for a in (v if type(v) is tuple else (v,))]
        shown = (a.__name__ if inspect.isclass(a) else repr(a) for a in args)
        return f'{type(self).__name__}({", ".join(shown)})'


class OfType(_Filter):
    """Matches instances of ``type``.

    Example
    -------
    >>> OfType(ParamState)((), ParamState(1.0))
    True
    """

    def __init__(self, type: type):
        if not inspect.isclass(type):
            raise TypeError(f'OfType(type) needs a class (e.g. ParamState), got {type!r}')
        self.type = type

    def __call__(self, path, x):   # (a TreefyState stands for a State of its ``type``)
        return isinstance(x, self.type) or type(x) is TreefyState and issubclass(x.type, self.type)


class WithTag(_Filter):
    """Matches states whose ``tag`` is ``tag`` (what a string filter means).

    Example
    -------
    >>> WithTag('hidden')((), State(0.0, tag='hidden'))
    True
    """

    def __init__(self, tag: str):
        if not isinstance(tag, str):
            raise TypeError(f'WithTag(tag) needs a str, got {tag!r}')
        self.tag = tag

    def __call__(self, path, x):
        return getattr(x, 'tag', None) == self.tag


class _Combination(_Filter):
    """Combines the predicates of several filters with ``_reduce`` (any / all)."""
    _reduce = staticmethod(any)

    def __init__(self, *filters):
        self.predicates = tuple(to_predicate(f) for f in filters)

    def __call__(self, path, x):
        return self._reduce(p(path, x) for p in self.predicates)


class Any(_Combination):
    """Matches when any of ``filters`` matches.

    Example
    -------
    >>> Any(ParamState, 'hidden')((), State(0.0, tag='hidden'))
    True
    """


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


class Everything(_Filter):
    """Matches every state.

    Example
    -------
    >>> Everything()((), State(0.0))
    True
    """

    def __call__(self, path, x):
        return True


class Nothing(_Filter):
    """Matches no state.

    Example
    -------
    >>> [Nothing()((), s) for s in (State(0.0), ParamState(1.0))]
    [False, False]
    """

    def __call__(self, path, x):
        return False


def to_predicate(the_filter) -> Callable:
    """Turns any filter into a predicate ``f(path, state) -> bool``.

    Example
    -------
    >>> pred = to_predicate((ParamState, 'hidden'))
    >>> pred((), ParamState(1.0)), pred((), State(1.0))
    (True, False)
    """
    if the_filter is True or the_filter is Ellipsis:
        return Everything()
    if the_filter is False or the_filter is None:
        return Nothing()
    if isinstance(the_filter, type):
        return the_filter() if issubclass(the_filter, (Everything, Nothing)) else OfType(the_filter)
    if isinstance(the_filter, str):
        return WithTag(the_filter)
    if isinstance(the_filter, (tuple, list)):
        return Any(*the_filter)
    if callable(the_filter):   # a predicate, or a filter already
        return the_filter
    raise TypeError(f'unsupported state filter {the_filter!r} ({type(the_filter).__name__}); use '
                    'a State subclass, a tag string, a predicate f(path, state), True/..., '
                    'False/None, a tuple/list of them, or OfType/Any/All/Not/Everything/Nothing')


class _StateCatcher(collections.abc.Sequence):
    """The States created inside a :func:`catch_new_states` block, in creation order."""

    def __init__(self, state_tag, state_to_exclude):
        self.state_tag, self.state_to_exclude = state_tag, to_predicate(state_to_exclude)
        self.state_ids, self.states = set(), []

    def append(self, state: State) -> None:
        if id(state) in self.state_ids or self.state_to_exclude((), state):
            return
        if self.state_tag is not None:
            state.tag = self.state_tag
        self.state_ids.add(id(state))
        self.states.append(state)

    def remove(self, state: State) -> None:
        if id(state) in self.state_ids:
            self.state_ids.discard(id(state))
            self.states.remove(state)

    def clear(self) -> None:
        self.state_ids.clear()
        self.states.clear()

    def get_states(self) -> list:
        return self.states

    def get_state_values(self) -> list:
        return [s.value for s in self.states]

    def get_by_tag(self, tag: str) -> list:
        return [s for s in self.states if s.tag == tag]

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index):
        return self.states[index]

    def __contains__(self, state) -> bool:
        return id(state) in self.state_ids


@contextlib.contextmanager
def catch_new_states(state_tag: str | None = None, state_to_exclude=None):
    """Collects the States created inside the block but ``state_to_exclude``, tagged ``state_tag``.

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


# =============================================================================
# 5. Cache and argument keys
#
# A stateful function keeps one trace per call signature, in a bounded LRU cache; static arguments
# count by value (``make_hashable``).  A key in words tells why a function traced again.
# =============================================================================

class hashabledict(dict):
    """A read-only ``dict`` hashable by its sorted items (used for cache keys).

    Example
    -------
    >>> k = hashabledict(static_args=(), dyn_args=())
    >>> {k: 1}[hashabledict(dyn_args=(), static_args=())]
    1
    """

    def __hash__(self):   # cached: a key is hashed on every lookup
        if '_hash' not in self.__dict__:
            self.__dict__['_hash'] = hash(tuple(sorted(self.items(), key=lambda kv: repr(kv[0]))))
        return self.__dict__['_hash']

    def _readonly(self, *args, **kwargs):
        raise TypeError('hashabledict is immutable (it is used as a cache key)')

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _readonly

    def __reduce__(self):   # copies and pickles rebuild it whole, never item by item
        return type(self), (dict(self),)

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
    if len(leaves) != 1 or leaves[0] is not obj:   # not itself a leaf
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
        self.maxsize, self._lock = int(maxsize), threading.RLock()
        self.clear()

    def _record(self, hit: bool) -> None:
        next(self._hits if hit else self._misses)

    def _items(self) -> list:   # ``(key, value)`` pairs, least recently used first
        with self._lock:
            return list(self._data.items())

    def _peek(self, key, default=None):
        """Lookup without statistics (refreshes recency)."""
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is not _MISSING:   # (no "in" test: each lookup compares a fresh key whole)
                self._data.move_to_end(key)
            return default if value is _MISSING else value

    def get(self, key, default=None, raise_on_miss: bool = False, error_context: str = 'item'):
        """The value for ``key`` (counted as a hit or miss)."""
        with self._lock:
            value = self._peek(key, _MISSING)
            self._record(value is not _MISSING)
            if value is _MISSING and raise_on_miss:
                available = '\n'.join(f'  - {k!r}' for k in self._data) or '  none'
                raise ValueError(
                    f'{error_context} not compiled for the requested cache key.\n'
                    f'Requested key: {key!r}\nAvailable keys:\n{available}\n'
                    'Call make_jaxpr() with these arguments first.')
            return default if value is _MISSING else value

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
            self._store(key, value)

    def pop(self, key, default=None):
        """Removes and returns the entry for ``key``."""
        with self._lock:
            return self._data.pop(key, default)

    def __contains__(self, key) -> bool:   # one dict lookup: needs no lock
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> list:
        """The stored keys, least recently used first."""
        return [key for key, _ in self._items()]

    def clear(self) -> None:
        """Removes every entry and resets the statistics."""
        with self._lock:
            self._data = collections.OrderedDict()
            # next() on an itertools.count is atomic, so the lock-free warm path can count.
            self._hits, self._misses = itertools.count(), itertools.count()

    def get_stats(self) -> dict:
        """``{size, maxsize, hits, misses, hit_rate}``; ``hit_rate`` in percent."""
        with self._lock:   # repr is a count's only public view of its position
            hits, misses = (int(repr(c)[len('count('):-1]) for c in (self._hits, self._misses))
            return {'size': len(self._data), 'maxsize': self.maxsize, 'hits': hits,
                    'misses': misses, 'hit_rate': 100.0 * hits / max(hits + misses, 1)}


_BoundedCache = BoundedCache   # brainstate 0.2.1's name for it


# -- Argument keys: static arguments by value, dynamic ones by structure and leaf signature.
def _static_spec(value, what: str) -> tuple:
    """One or a sequence of ints (``static_argnums``) or strs (``static_argnames``), as a tuple."""
    names = what == 'static_argnames'
    one = (lambda a: isinstance(a, str)) if names else _is_int
    items = () if value is None else (value,) if one(value) else value
    if isinstance(items, Iterable) and not isinstance(items, (str, bytes, dict)):
        if all(map(one, items := tuple(items))):
            return items if names else tuple(map(operator.index, items))
    raise TypeError(f'{what} must be {"a str" if names else "an int"} or a sequence of them, '
                    f'got {value!r}')


def _static_positions(sf, nargs: int) -> tuple:
    """The static positions of a call with ``nargs`` positional arguments: ``static_argnums``,
    and those the signature gives ``static_argnames`` where no ``static_argnums`` are (as
    jax.jit: a static argument passed by position stays static)."""
    for i in sf.static_argnums:
        if not -nargs <= i < nargs:
            raise ValueError(
                f'{_who(sf)}: static_argnums contains {i}, but the call passed only {nargs} '
                'positional argument(s); pass that argument positionally or fix static_argnums')
    return tuple(sorted({i % nargs for i in sf.static_argnums} | {
        i for i in sf._named_at if i < nargs}))


def _positions_of(fun, names) -> tuple:
    """The positions of ``fun``'s parameters named ``names`` that a caller may pass by position."""
    try:
        params = inspect.signature(fun).parameters.values() if names else ()
    except (TypeError, ValueError):   # (no signature: keywords only)
        return ()
    return tuple(i for i, p in enumerate(params) if p.name in names and p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _static_key(value):
    """``(type, make_hashable(value), the types within)``: [1, [2]] and [1, (2,)], [1] and
    [True] (as jax.jit's 1 and 1.0 may), or dicts in another order, trace apart."""
    def types(obj):
        kids = ([(repr(k), types(v)) for k, v in obj.items()] if isinstance(obj, dict) else
                map(types, obj) if isinstance(obj, (list, tuple, set, frozenset)) else None)
        return type(obj) if kids is None else (type(obj), (frozenset if isinstance(
            obj, (set, frozenset)) else tuple)(kids))
    return type(value), make_hashable(value), types(value)


def _hash_static(sf, where: str, value):
    _reject_states(value, f'{_who(sf)}: static {where}')
    h = _static_key(value)
    try:
        hash(h)
    except TypeError:
        raise TypeError(f'{_who(sf)}: static {where} of type {type(value).__name__} is not '
                        'hashable; static arguments are cache keys. Pass a hashable value (e.g. a '
                        'tuple) or make the argument dynamic') from None
    return h


def _explain_bad_leaves(sf, dyn_args, dyn_kwargs):
    """Raises the error naming the first dynamic argument leaf that is not a JAX value."""
    def refuse(err, path, leaf):
        where = f'{_who(sf)}: dynamic {what}{path}'
        if isinstance(err, OverflowError):
            return OverflowError(f'{where} is the Python int {leaf}, out of range for the '
                                 'default integer dtype; pass an array of a wide enough dtype '
                                 '(int64 needs jax_enable_x64) or mark it static')
        return TypeError(f'{where} has type {type(leaf).__name__}, which is not a JAX type; mark '
                         'it static (static_argnums / static_argnames; for grad: bind it with '
                         'functools.partial) or pass an array')
    for what, tree in (('argument ', dyn_args), ('keyword argument ', dyn_kwargs)):
        _reject_states(tree, f'{_who(sf)}: {what}', refuse)


def _rebuilder(split):
    """``rebuild(flat) -> (args, kwargs)`` putting static values back in place."""
    static_args, dyn_args, static_kwargs, dyn_kwargs = split
    tree = jax.tree_util.tree_structure((dyn_args, dyn_kwargs))
    statics, nargs = dict(static_args), len(dyn_args) + len(static_args)

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
        self.value, self._key = value, _static_key(value)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _StaticArg) and self._key == other._key


# -- A key in words -------------------------------------------------------------
def _sig_text(shape, dtype, weak_type: bool, spec=None, mesh=None) -> str:
    """``float32[3,4]``, then ``weak`` for a weakly typed value, an explicit spec, the mesh."""
    axes = '' if mesh is None else ' on mesh ' + ','.join(f'{a}={n}' for a, n in mesh.shape.items())
    return (f'{dtype}[{",".join(map(str, shape))}]' + (' weak' if weak_type else '')
            + ('' if spec is None else f' {spec}') + axes)


def _value_text(sig) -> str:
    """A state value signature from ``_value_sig`` in words."""
    treedef, leaves = sig
    if len(texts := [_sig_text(*leaf) for leaf in leaves]) == 1 and treedef.num_nodes == 1:
        return texts[0]
    return '{' + ', '.join(f'{jax.tree_util.keystr(p)}: {t}'
                           for p, t in zip(_leaf_paths(treedef), texts, strict=True)) + '}'


def _leaf_paths(treedef) -> list:
    """The key path of each leaf of ``treedef`` (rebuilt with placeholder leaves)."""
    try:
        tree = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
        return [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    except Exception:  # a pytree class whose unflatten checks its leaves
        return [(jax.tree_util.FlattenedIndexKey(i),) for i in range(treedef.num_leaves)]


def _arg_labels(key) -> list:
    """``argument 0['w'][1]`` / ``keyword 'scale'`` per flat dynamic leaf of a cache key."""
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
    """``(label, (type, value as hashed))`` of each static argument in a cache key."""
    return ([(f'static argument {i}', v) for i, v in key['static_args']]
            + [(f'static argument {k!r}', v) for k, v in key['static_kwargs']])


def _key_summary(key) -> str:
    """The call a cache key describes, in words: ``argument 0: float32[3], ...``."""
    sigs = key['dyn_args'][1] + key['dyn_kwargs'][1]
    items = [f'{name}: {_sig_text(*sig)}' for name, sig in zip(_arg_labels(key), sigs, strict=True)]
    items += [f'{name}={value!r}' for name, (_, value, *_) in _static_items(key)]
    more = f', ... ({len(items) - 6} more)' if len(items) > 6 else ''
    return ', '.join(items[:6]) + more or 'no arguments'


# -- Why a function traced again -----------------------------------------------
_EXPLAIN_ENV = 'STATEFUL_JAXPR_EXPLAIN_CACHE_MISSES'
_explain_default = [os.environ.get(_EXPLAIN_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on')]


def explain_cache_misses(enabled: bool = True) -> bool:
    """Turns cache-miss explanations on or off where no ``explain_cache_misses=`` was given,
    returning the previous setting (on at import with ``STATEFUL_JAXPR_EXPLAIN_CACHE_MISSES=1``).
    When on, each retrace logs a warning on the ``stateful_jaxpr`` logger: the nearest cached
    entry and what differs (arguments, static values, States' shapes, States (no longer) touched).

    Example
    -------
    >>> previous = explain_cache_misses(True)
    >>> sf = StatefulFunction(lambda x: x * 2)
    >>> _ = sf(jnp.ones(2)); _ = sf(jnp.ones(3))     # logs: argument 0: float32[2] -> float32[3]
    >>> sf.get_miss_causes()
    {'first trace': 1, 'argument shape/dtype': 1}
    >>> _ = explain_cache_misses(previous)
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f'explain_cache_misses(enabled) needs True or False, got {enabled!r}')
    previous, _explain_default[0] = _explain_default[0], bool(enabled)
    return previous


def _key_differences(old, new, labels) -> list:
    """``(cause, line)`` for each way cache key ``new`` (argument labels ``labels``) differs."""
    olds, news = dict(_static_items(old)), dict(_static_items(new))
    shown = lambda d, k, other: '(not passed)' if k not in d else repr(d[k][1]) + (  # noqa: E731
        f' ({d[k][0].__name__})' if k in other and other[k][0] is not d[k][0] else
        ' (of other types within)' if k in other and other[k][2] != d[k][2] else '')
    found = [('static argument', f'{k}: {shown(olds, k, news)} -> {shown(news, k, olds)}')
             for k in {**olds, **news} if olds.get(k, _MISSING) != news.get(k, _MISSING)]
    for part, what in (('dyn_args', 'positional'), ('dyn_kwargs', 'keyword')):
        (tree_a, sigs_a), (tree_b, sigs_b) = old[part], new[part]
        here, labels = labels[:len(sigs_b)], labels[len(sigs_b):]
        if tree_a != tree_b:
            found.append(('argument structure', f'{what} argument structure: {tree_a} -> {tree_b}'))
        else:
            found += [('argument shape/dtype', f'{label}: {_sig_text(*a)} -> {_sig_text(*b)}')
                      for label, a, b in zip(here, sigs_a, sigs_b, strict=True) if a != b]
    return found


def _state_differences(old_traced, new_traced) -> list:
    """``(cause, line)`` per State whose value changed shape, or which one trace lacks."""
    found = [('state shape/dtype', f'{s._describe()}: {_value_text(sig)} -> {_value_text(now)}')
             for s, sig in zip(old_traced.states, old_traced.state_sigs, strict=True)
             if (now := _value_sig(s._value)) != sig]
    old_ids, new_ids = ({id(s) for s in t.states} for t in (old_traced, new_traced))
    found += [('new state', f'newly touched: {s._describe()}')
              for s in new_traced.states if id(s) not in old_ids]
    found += [('vanished state', f'no longer touched: {s._describe()}')
              for s in old_traced.states if id(s) not in new_ids]
    return found + [('jax setting', f'{n}: {a!r} -> {b!r}' if n != 'other' else 'a setting '
                     'jax.jit keys its traces on: ' + ', '.join(f'{x!r} -> {y!r}' for x, y in zip(
                         a, b) if x != y)) for n, a, b in zip(
        _TRACE_SETTINGS, old_traced.settings, new_traced.settings, strict=True) if a != b]


# =============================================================================
# 6. The tracing core
#
# ``_trace_stateful`` turns ``fun(*args, **kwargs)`` into a ClosedJaxpr: inputs the flat dynamic
# arguments, then each touched State in first-touch order; outputs the flat results, then the
# returned states.  Reads and writes go to a ``_TraceFrame``, so no tracer enters a State and a
# failed trace has nothing to restore; a first touch, even deep inside ``lax.scan``, ``grad`` or
# a ``jit``, adds an input on the outer trace, not a constant.  A State *written* in such a nested
# transformation is lifted as Refs (``_RefCell``), which JAX's discharge threads out; inside a
# differentiation it is a local variable of the differentiated program, loop bodies too.
# JAX caches bodies and jitted functions, which may hold a finished trace's tracer or a State's
# stale value: where needed ``_Retracer`` *isolates* a trace (``_fresh_epoch``), so those miss.
# =============================================================================

class _Traced:
    """Everything one trace produced; immutable once built."""
    __slots__ = ('closed_jaxpr', 'out_tree', 'out_avals', 'states', 'returned', 'state_tree',
                 'full_tree', 'state_sigs', 'trace_stack', 'cacheable', 'n_out', 'rules',
                 'settings')

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    def runner(self, staged: str | None = None) -> Callable:
        """``run(state_values, flat_args, how='') -> (out, returned_state_values)``: the
        equations bound one by one, or ``staged`` as one jit equation of that name (_staged),
        unless a custom rule must see them inline (it reads States when JAX traces it) or the
        function closed over an enclosing trace's value (a jit equation holds only constants);
        ``how``: 'whole', a jit's whole program, inlined in any case; 'eager', one by one, NaNs
        checked where jax_debug_nans says (JAX's rerun of a jit)."""
        closed, n_out = self.closed_jaxpr, self.n_out
        inline = staged is None or self.rules or _contains_tracer(closed.consts)
        runs = {'eager': _evaluated(closed), '': _jaxpr_as_fun(closed) if inline else _staged(
            closed, staged)}
        runs['whole'] = runs[''] if inline else _staged(closed, staged, whole=True)
        out_tree, state_tree = self.out_tree, self.state_tree

        def apply(state_values, flat_args, how: str = ''):
            outs = runs[how](*flat_args, *_leaves(state_values))
            return out_tree.unflatten(outs[:n_out]), state_tree.unflatten(outs[n_out:])
        return apply

    def out_shapes(self):
        """``(out_shapes, state_part)`` as ``jax.ShapeDtypeStruct`` pytrees."""
        return self.full_tree.unflatten([jax.ShapeDtypeStruct(a.shape, a.dtype)
                                         for a in self.out_avals])


class _GcPause:
    """Pauses automatic collections while tracing (rescanning a trace's objects slows thousands of
    States); traces share one pause, its threshold put back unless another thread changed it."""
    count, first, lock = 0, None, threading.Lock()   # active pauses, the threshold before them
    PAUSED = 2 ** 30   # a first threshold no allocation count reaches

    def __enter__(self):
        with _GcPause.lock:
            if _GcPause.count == 0:
                _GcPause.first, *later = gc.get_threshold()
                gc.set_threshold(_GcPause.PAUSED, *later)
            _GcPause.count += 1

    def __exit__(self, *exc):
        with _GcPause.lock:
            _GcPause.count -= 1
            first, *later = gc.get_threshold()
            if _GcPause.count == 0 and first == _GcPause.PAUSED:
                gc.set_threshold(_GcPause.first, *later)


# -- The trace frame ----------------------------------------------------------
class _TraceFrame(StateTraceStack):
    """One run's overlay: a State's first touch adds jaxpr inputs (a _RefCell's Refs where its
    retracer says so); what the run sees that decides a rerun goes to the retracer."""
    loopless = _TraceSet()   # JAX traces neither in a loop body nor inside one

    def __init__(self, name: str, retracer: '_Retracer', lift_aval):
        """Binds the run's epoch (see _Retracer) until exit."""
        super().__init__(name=name)
        self._overlays, self._jax_trace = True, _current_trace()   # new inputs: here, not nested
        self.retracer, self._lift_aval = retracer, lift_aval
        self._diffs: dict = {}                  # id -> a differentiation a State was written in
        self._diff_written: dict = {}           # id -> a State written so (see peel)
        self._inputs: dict = {}                 # id(input tracer) -> its State
        self.cells: list = []                   # the _RefCells, for the discharge
        self.sigs: dict = {}                    # id(state) -> its traced signature
        self.inlined: set = set()               # ids of the nested functions run inline here
        retracer.bind()

    def _hand_on(self, entries) -> None:   # by _trace_stateful, once no run follows this one
        self.side = entries

    def _lift(self, state, current):
        """New jaxpr inputs for ``state``: Refs, in a _RefCell, if known to be written so."""
        if type(current) is _RefCell:    # an enclosing trace holds it as Refs (of its value's
            treedef, avals = current.treedef, [   # weak type, see _RefCell.weak)
                a.update(weak_type=w) for a, w in zip(current.avals, current.weak, strict=True)]
        else:
            leaves, treedef = jax.tree_util.tree_flatten(current)
            try:
                avals = [_aval_of(leaf) for leaf in leaves]
            except TypeError as err:
                raise TypeError(f'{state._describe()} holds a leaf that is not a JAX array '
                                f'({err}); assign it an array') from None
        self.sigs[id(state)] = (treedef, tuple(map(_aval_sig, avals)))
        if self._lift_aval is not None:
            avals = [self._lift_aval(state, a) for a in avals]
        if state in self.retracer.lessons.ref_states or self._in_loop():
            return self.cell(state, treedef, avals)
        leaves = [_new_arg(self._jax_trace, a) for a in avals]
        self._inputs.update(dict.fromkeys(map(id, leaves), state))   # (see finish)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _in_loop(self) -> bool:
        """Whether a first touch now is in a loop body, whose reads must see an earlier
        iteration's write should a later touch write the State: lifted as Refs at once, so that
        the trace needs no second run (not under jax.vmap, a cond, checkpoint, shard_map or pmap
        body: shard_map and pmap take no Ref in)."""
        if (trace := _current_trace()) in self.loopless:   # (each frame around a touch asks)
            return False
        if not any(_body_of(t) == 'loop' for t in _trace_path(None)[0]):
            self.loopless.add(trace)
        path, whole = _trace_path(self._jax_trace)
        return _HAS_REFS and whole is True and any(_body_of(t) == 'loop' for t in path) and all(
            _body_of(t) in ('loop', '') if _stages(t)
            else _new_ref is not None and (_jvps(t) or _linearizes(t)) for t in path)

    def cell(self, state, treedef, avals, improvised: bool = False) -> '_RefCell':
        cell = _RefCell(state, [_new_arg(self._jax_trace, _ref_type(a)) for a in avals],
                        treedef, avals, self._jax_trace, improvised)
        self.cells.append(cell)
        cell.tie = self.retracer.lessons.tie   # (see _tied)
        self._inputs.update(dict.fromkeys(map(id, cell.refs), state))
        return cell

    def inline(self, name: str, fun: Callable, args, kwargs):
        """``fun(*args, **kwargs)`` run in this trace, as if written here (a nested
        StatefulFunction's, see its _call_in_trace), its result made JAX values as a trace of its
        own would.  Should it raise, the error ends the run, or else, caught, the run starts
        again with every nested function traced apart (see _Retracer): what it wrote and staged
        here (a Ref written, a callback) cannot be undone."""
        made = len(self._owned)
        try:
            out = _result(name, fun(*args, **kwargs))
        except BaseException as err:
            if not isinstance(err, _Redo):
                self.retracer.inline_raised(err)
            raise
        finally:   # (States made inside: as at the end of a trace of its own)
            _release(self._owned[made:])
            del self._owned[made:]
        return jax.tree_util.tree_map(lambda x: x if isinstance(x, Tracer) else jnp.asarray(x),
                                      out)

    def finish(self, out, return_only_write: bool) -> list:
        """The flat jaxpr outputs: ``out``'s leaves, then the returned states' values but those a
        _RefCell holds, which the discharge gives after them (``picks``: where each output is)."""
        if leaked := {self._inputs[id(c)] for c in _nested_consts(_staged_eqns(self._jax_trace))
                      if id(c) in self._inputs}:   # read by a rule JAX traced apart, left there
            raise _cannot('apart', ', '.join(sorted(s._describe() for s in leaked)))
        out_leaves, out_tree = jax.tree_util.tree_flatten(_result(self.name, out))
        returned = [i for i, w in enumerate(self.been_writen) if w or not return_only_write]
        values = [v if type(v) is _RefCell and v.final() else v.read() if type(v) is _RefCell
                  else self.peel(v) if self._diffs else v
                  for v in (self._values[id(self.states[i])] for i in returned)]
        for i, v in zip(returned, values):
            if type(v) is not _RefCell:
                _refuse_non_jax(self.states[i], v, self.name)
        kept = out_leaves + [x for v in values if type(v) is not _RefCell for x in _leaves(v)]
        after = itertools.count(len(kept))   # the discharge gives each cell's finals in turn
        finals = {id(c): [next(after) for _ in c.avals] for c in self.cells}
        spare = iter(range(len(out_leaves), len(kept)))
        self.picks = [*range(len(out_leaves)), *(i for v in values for i in (
            finals[id(v)] if type(v) is _RefCell else itertools.islice(spare, len(_leaves(v)))))]
        shaped = [v.treedef.unflatten(v.avals) if type(v) is _RefCell else v for v in values]
        # (out, per State its value or None): as brainstate's jaxpr_call and out_treedef expose it.
        part = tuple(map(dict(zip(returned, shaped)).get, range(len(self.states))))
        self.result = dict(out_tree=out_tree, n_out=len(out_leaves), returned=tuple(returned),
                           state_tree=jax.tree_util.tree_structure(shaped),
                           full_tree=jax.tree_util.tree_structure((out, part)))
        return kept

    def traced(self, closed, out_avals) -> _Traced:
        """The trace's result; refused where a nested jaxpr keeps some other trace's tracer."""
        if any(isinstance(c, Tracer) for c in _nested_consts(closed.jaxpr.eqns)):
            raise _cannot('apart', 'a traced value')
        return _Traced(closed_jaxpr=closed, out_avals=list(out_avals), states=tuple(self.states),
                       trace_stack=StateTraceStack(name=self.name).merge(self),
                       state_sigs=tuple(self.sigs[id(s)] for s in self.states),
                       cacheable=not any(isinstance(c, Tracer) for c in closed.consts),
                       rules=_has_custom_rules(closed.jaxpr), settings=_settings(), **self.result)

    def peel(self, value, alive=frozenset()):
        """``value`` with each tracer of a differentiation a State was written in directly that
        has ended (not in ``alive``, ids) replaced by its primal: the State is a local variable
        of the differentiated function, which afterwards holds the primal value."""
        def primal(x):
            while isinstance(x, Tracer) and id(t := _tracer_trace(x)) in self._diffs and (
                    id(t) not in alive):
                x = _primal(x, t)
            return x
        return jax.tree_util.tree_map(primal, value)

    def __exit__(self, *exc):   # (left first: reading the error may fail, e.g. out of stack)
        try:
            return super().__exit__(*exc)
        finally:
            self.retracer.unbind()
            if exc[1] is not None and _refusal(exc[1]):   # JAX refusing what such a local does
                self.retracer.wrote_unlifted(self._diff_written.values())

    def _close(self):
        super()._close()
        self._originals = [None] * len(self.states)   # a finished trace's tracers


def _result(name: str, out):
    """``out``, refused where a leaf is a State or not a JAX type."""
    _reject_states(out, 'the function returned ', lambda err, path, leaf: err if isinstance(
        err, OverflowError) else TypeError(
        f'the stateful function {name!r} returned {leaf!r} (a {type(leaf).__name__}) at '
        f'result{path}, which is not a JAX type; return arrays, scalars or pytrees of them'))
    return out


# -- Traced reads and writes --------------------------------------------------
def _touch_all(state, frames, write: bool):
    """Records ``state`` in every frame that sees it (past its owner, for a State made in a
    trace); returns the innermost overlaying frame's entry (value or _RefCell) and that frame."""
    top = frames[-1]   # a trace frame's first touch reached all frames below (a recorder: none)
    if (v := top._values.get(id(state), _MISSING)) is not _MISSING and (not write or type(
            top) is _TraceFrame and top.been_writen[top._index[id(state)]]):
        return v, top
    owner = state._owner
    start = len(frames) - frames[::-1].index(owner) if owner in frames else 0
    if start == 0 and state._broken is not None:
        state._raise_broken()
    current, source = state._value, None
    for i, frame in enumerate(frames[start:], start):
        if frame._overlays:   # (a trace frame is written where the write lands, see below)
            current, source = frame._touch(state, current, write and type(
                frame) is not _TraceFrame), frame
        elif i >= state._stack_level:   # (as brainstate's: a recorder below its level sees none)
            frame._touch(state, current, write)
    if write and type(source) is _TraceFrame:   # (one a nested trace, failing, never reaches)
        source.been_writen[source._index[id(state)]] = True
    return current, source


def _view(state, entry, frame):
    """What traced code reads for ``entry``, ``frame``'s view of ``state``; one written directly in
    differentiations whose end is unknown here (.. 0.5 in a body, a custom rule): redone as Refs."""
    if type(entry) is _RefCell:
        return entry.read()
    if frame is None or frame._jax_trace is None or (
            _current_trace() is frame._jax_trace and id(state) not in frame._diff_written):
        return entry
    path, whole = _trace_path(frame._jax_trace)
    if id(state) in frame._diff_written:
        if whole is not True:
            frame.retracer.read_unknown_end(state)
        entry = frame.peel(entry, set(map(id, path)))
    frame.retracer.read_nested(state, _in_body(path, whole), path and not all(
        isinstance(x, Tracer) for x in _leaves(entry)))
    return entry


def _in_body(path, whole) -> bool:
    """Whether the traces ``path`` (from ``_trace_path``) build a body JAX may cache."""
    return not whole or any(map(_stages, path))


def _traced_write(state, value, frames, written: bool):
    """Writes ``value`` into the innermost overlay's view of ``state`` (its Refs where held so),
    else into the State; a first write inside a nested transformation other than
    differentiations alone (in which the State is a local variable) gives it Refs."""
    entry, target = _touch_all(state, frames, write=written)
    local = False   # written directly in differentiations (see _TraceFrame.peel)
    if type(entry) is not _RefCell and target is not None and target._jax_trace is not None:
        path, whole = _trace_path(target._jax_trace)
        if whole is True and all(_jvps(t) or _linearizes(t) for t in path):
            if path:
                local = True
                target._diffs.update((id(t), t) for t in path)
                target._diff_written[id(state)] = state
            target.retracer.wrote(state)
        else:
            if not _HAS_REFS:
                raise _cannot('refs', state._describe())
            # Until the rerun lifts it from the start, improvised Refs keep the write in the
            # body, lest JAX cache that body without it.
            leaves, treedef = jax.tree_util.tree_flatten(entry)
            entry = target.cell(state, treedef, [_aval_of(x) for x in leaves], True)
            target._values[id(state)] = entry
            target.retracer.wrote_unlifted([state], _in_body(path, whole))
    if type(entry) is _RefCell:
        entry.write(value)
        return
    allowed = tuple(f._jax_trace for f in frames if f._jax_trace is not None)
    _check_tracers_may_enter(state, target.peel(value) if local else value, allowed)
    if target is None:   # only recording stacks (or the creating trace) above
        _store(state, value)
    else:
        target._values[id(state)] = value


# -- Writes inside nested transformations: Refs ----------------------------------
_STALE = object()   # a level a nested differentiation wrote where its primal cannot reach


# What a State cannot do and the way out, by kind; ``{jax}``: JAX's release, ``{err}``: its error.
_CANNOT = {
    'effects': 'is written inside a nested transformation that JAX {jax} cannot carry it through: '
               '"{err}" (e.g. a lax.cond under jax.vmap or reverse-mode differentiation).  Return '
               'the value from it and assign it outside (for a cond: s.value = jnp.where(pred, '
               'new, s.value)), or under jax.vmap map the function with StatefulMapping instead',
    'batched': 'is written inside a nested transformation with a value JAX batches across jax.vmap '
               'lanes (one differing per lane, or any under jax.jacfwd / jax.hessian on recent '
               'JAX), which an unbatched State cannot hold: map the function with StatefulMapping, '
               'differentiate with jax.jacrev, or return the value and assign it outside',
    'tangent': 'is written inside a loop, jit or jax.checkpoint body nested in a differentiated '
               "function, where JAX {jax} would drop the written value's derivative, or refuses "
               'it (JAX 0.7 and newer keep it).  Carry its value through the loop (lax.scan(body, '
               '(c, h.value), xs), body returning it) or return it from the jit, then assign it',
    'while': 'is written inside a lax.while_loop (or a fori_loop with traced bounds), or read '
             'there carrying a derivative (read there after a write in the differentiated '
             'function, or differentiated itself), under reverse-mode differentiation or '
             'jax.linearize, which JAX cannot differentiate: loop with lax.scan or a fori_loop '
             'with static bounds',
    'transpose': 'is written inside a loop or jit body under nested reverse-mode differentiation, '
                 'which JAX {jax} fails to transpose (JAX 0.7 and 0.11 do not): write it in the '
                 'differentiated function, or carry its value through the body and assign it after',
    'jacrev': 'is written under jax.jacrev inside a loop or jit body, or where one reads it, which '
              'JAX {jax} cannot batch (newer JAX can): take one output row at a time with jax.vjp, '
              'or carry its value through the body (a read: into a local before it)',
    'checkpoint': 'is written inside a differentiated jax.checkpoint function, which JAX runs '
                  'again to rematerialize it, so the write would happen twice.  Checkpoint it '
                  'with stateful_jaxpr.checkpoint, which writes its States outside the '
                  'rematerialized part, or write the State outside the checkpointed function',
    'cond': 'is written inside a lax.cond / lax.switch branch under differentiation (reverse '
            'mode: jax.grad, jax.vjp, jax.linearize ...; any before JAX 0.7), where JAX {jax} '
            'cannot carry a write.  '
            'Compute both outcomes and select: s.value = jnp.where(pred, new, s.value), or '
            'return the value from the cond (or switch) and assign it outside, or differentiate '
            'with stateful_jaxpr.grad, which traces the function before differentiating it',
    'apart': 'is read by a custom_vjp / custom_jvp rule that JAX traces apart from the program '
             '(one applied in a loop, cond or jit body, or a nested StatefulFunction, under a '
             'differentiation), leaving the value behind.  Read it outside the custom function '
             'and pass it in as an argument (for a custom_vjp backward rule: a residual of its '
             'forward rule)',
    'parents': 'was written inside a differentiated function and is used inside a jit or loop '
               'body nested in some transformation, where JAX {jax} cannot tell whether that '
               'differentiation is still running.  Read the value into a local variable before '
               'the body, or use JAX 0.7 or newer',
    'outer': 'was written inside a differentiation nested in another (jax.grad inside jax.grad '
             '...) and is read in the outer one, where JAX {jax} cannot give it the outer '
             'derivative.  Return the value from the inner differentiated function '
             '(has_aux=True) and assign it in the outer one',
    'dropped': 'is written inside a loop or jit body whose write JAX {jax} moved out of the body '
               'or dropped while differentiating (or whose trace raised an error the function '
               'caught); return the value from the body and assign it outside, or use JAX 0.7 '
               'or newer',
    'mapped': 'is written inside a shard_map or pmap body, or read there while a loop, cond or '
              'jit body writes it, which JAX {jax} cannot carry into it ({err}).  Return the value '
              'from the body and assign it outside, or read it into a local variable before it',
    'varying': 'is written inside a shard_map body with a value that differs between devices '
               '(varies over mesh axes), which one State cannot hold.  Return it from the body '
               'through out_specs and assign it outside (reduced first, e.g. jax.lax.psum)',
    'thread': 'is written inside a nested transformation that JAX {jax} cannot thread state out '
              'of ({err}): return the value and assign it outside',
    'refs': 'is written inside a nested JAX transformation; ' + _NO_REFS + '.  Return the value '
            'from the transformation and assign it outside',
}


def _cannot(kind: str, described: str, err=None) -> TraceContextError:
    return TraceContextError(f'{described} ' + _CANNOT[kind].format(jax=jax.__version__, err=err))


class _Level:
    """What a _RefCell holds in one differentiation it is touched in: ``content`` (a value, or Refs
    made inside that differentiation when ``refs``), and whether it was ``written`` there."""
    __slots__ = ('trace', 'content', 'written', 'refs')

    def __init__(self, trace, content):
        self.trace, self.content, self.written, self.refs = trace, content, False, False


class _RefCell:
    """A State lifted as Refs, one per leaf, for a write inside a nested transformation; reads and
    writes bind at the current JAX trace.  In differentiated functions it is a local variable:
    each differentiation (``jax.grad``, ``jax.jvp`` ...) it is touched in keeps a _Level,
    outermost first, whose value (set by direct writes) becomes Refs made inside that
    differentiation once a body nested in it touches the State (JAX 0.7 .. differentiates through
    those; before, such a body may write only a value without a tangent).  Reads and writes use
    the innermost level, with its tangents; ``refs`` always get the primal.  An ended
    differentiation's level hands its primal to its parent's."""
    __slots__ = ('state', 'refs', 'treedef', 'avals', 'home', 'levels', 'nested', 'staged',
                 'linearized', 'blind', 'improvised', 'adopted', 'weak', 'in_cond', 'in_while',
                 'tie')

    def __init__(self, state, refs, treedef, avals, home, improvised):
        self.state, self.refs, self.treedef, self.avals = state, refs, treedef, avals
        self.home, self.levels = home, []     # the stateful trace's own JAX trace, the levels
        self.nested = self.staged = self.in_cond = self.in_while = False   # written nested, in a
        # body, a cond under a differentiation, a while loop under a linearization
        self.linearized = False               # written in a body under jax.linearize / grad
        self.blind = False                    # in a body whose outer traces JAX hides (.. 0.5)
        self.improvised = improvised          # made at a write, in a trace that is redone
        self.adopted = False                  # ``refs`` are a differentiation's primal Refs
        # Per leaf: whether the last value written is weak, as a loop carry's or a jit's result;
        # a cond branch's write keeps it (JAX's cond keeps branch 0's, which often passes it on).
        self.weak = [a.weak_type for a in avals]

    def _level(self):
        """``(level, at)``: the innermost level here (None: none), ended ones folded into their
        parents, new differentiations' added; ``at``: the body it is read outside of, or None."""
        path, whole = _trace_path(self.home)
        if self.improvised:   # (keeps no tangents: the trace is redone)
            return None, None
        if not whole and any(lv.written and not _tells(path, lv.trace) for lv in self.levels):
            raise _cannot('apart' if whole is None else 'parents', self.state._describe())
        diffs, levels = [t for t in reversed(path) if _jvps(t) or _linearizes(t)], self.levels
        while levels and (len(levels) > len(diffs)
                          or levels[-1].trace is not diffs[len(levels) - 1]):
            ended = levels.pop()
            if ended.written and levels:   # hand the primal to the parent, if it is the parent
                parent, trace = levels[-1], ended.trace
                parent.content = (jax.tree_util.tree_map(lambda x: _primal(x, trace), ended.content)
                                  if _parent(trace) is parent.trace else _STALE)
                parent.written, parent.refs = True, ended.refs
            elif ended.written and ended.refs and _parent(ended.trace) is self.home:   # see write
                self.refs, self.adopted = [_primal(x, ended.trace) for x in ended.content], True
        for trace in diffs[len(levels):]:
            levels.append(_Level(trace, self._get(levels[-1] if levels else None, trace)))
        if not levels:
            return None, None
        # JAX takes no Ref of a differentiation into a rematerialized body, nor into a cond's
        # under linearization (reverse mode): those read the level outside them, write none.
        level, linear = levels[-1], _linearizes(levels[-1].trace)
        opaque = [t for t in path[:path.index(level.trace)]
                  if _body_of(t) == 'checkpoint' or linear and _body_of(t) == 'cond']
        if not level.refs and path[0] is not level.trace:   # a body nested in it touches it
            if not any(lv.written for lv in levels) and (
                    not _new_ref or opaque and _body_of(opaque[-1]) == 'cond'):
                del levels[:]   # no tangent yet: the primal, in ``refs``, serves there
                return None, None
            if _new_ref:   # Refs made inside the differentiation, which JAX differentiates
                with _at_trace(level.trace):
                    level.content = _diff_refs(self._get(level), self.avals, self.refs)
                level.refs = True
        return level, opaque[-1] if opaque else None

    def _get(self, level, at=None):
        """The value ``level`` (None: the primal) holds, read at trace ``at`` (None: here)."""
        if level is not None and level.content is _STALE:
            raise _cannot('outer', self.state._describe())
        if level is not None and not level.refs:
            return level.content
        with contextlib.nullcontext() if at is None else _at_trace(at):
            leaves = [_ref_get(r, ()) for r in (self.refs if level is None else level.content)]
            return self.treedef.unflatten([x if x.aval.weak_type == w else _weakly(x) if w else
                                           jax.lax.convert_element_type(x, x.dtype)
                                           for x, w in zip(leaves, self.weak)])   # (see weak)

    def final(self) -> bool:   # whether its Refs hold its value at the end (see _level)
        self._level()
        return not self.adopted

    def read(self):
        level, at = self._level()
        return self._get(level, None if at is None else _parent(at))

    def write(self, value) -> None:
        """Writes ``value`` at the current trace: into the innermost level, and its primal into
        ``refs``; refuses what JAX could not differentiate there."""
        leaves, trace = self._leaves_for(value), _current_trace()
        self.nested = self.nested or trace is not self.home
        self.staged = self.staged or (_stages(trace) and trace is not self.home)
        path, whole = _trace_path(self.home)
        if not any(_body_of(t) == 'cond' for t in path):   # (see weak)
            self.weak = [_aval_of(x).weak_type for x in leaves]
        self.in_cond = self.in_cond or any(_body_of(t) == 'cond' for t in path) and (
            whole is not True or any(_jvps(t) or _linearizes(t) for t in path))   # (under one)
        self.linearized = self.linearized or any(map(_stages, path)) and any(map(_linearizes, path))
        self.in_while = self.in_while or any(map(_linearizes, path)) and any(
            _made_for(t).startswith('while') for t in path)   # (its writes rerun by the linear map)
        self.blind = self.blind or whole is not True
        if _drops_ref_tangents(self.home):
            raise _cannot('cond' if self.in_cond else 'tangent', self.state._describe())
        level, at = self._level()
        if at is not None:   # (a differentiated value already)
            raise _cannot(_body_of(at), self.state._describe())   # 'checkpoint' or 'cond'
        if level is not None and not level.refs:
            if trace is not level.trace:   # a body in a differentiation that gave it a tangent
                raise _cannot('tangent', self.state._describe())
            level.content = self.treedef.unflatten(leaves)
        try:
            if level is not None:
                level.written = True
            if level is not None and level.refs:
                for ref, leaf in zip(level.content, leaves, strict=True):
                    _ref_set(ref, (), _tied(leaf, ref) if self.tie else leaf)
            # A differentiation of the stateful trace itself whose level holds Refs carries the
            # value in their primals, which ``refs`` take when it ends: no second loop carry.
            adopts = level is not None and level.refs and len(self.levels) == 1 and (
                _parent(level.trace) is self.home)
            _set_refs(() if adopts else self.refs, leaves, level is not None or self.improvised)
        except Exception as err:
            if self.improvised:   # (a trace that is redone anyway: abort it, leaving no body)
                raise _Redo from err
            if _refusal(err) == 'varying':
                raise _cannot('varying', self.state._describe()) from err
            raise TraceContextError(
                f'{self.state._describe()} cannot be written inside this nested JAX transformation '
                f'({type(err).__name__}: {err}).  A value written inside jax.vmap (one varying '
                'across lanes; on recent JAX any, under jax.jacfwd / jax.hessian too) cannot go '
                'into an unbatched State: map the function with StatefulMapping, use jax.jacrev, '
                'or return the value from the transformation and assign it outside') from err

    def _leaves_for(self, value) -> list:
        """``value``'s leaves, checked against the Refs; a weakly typed leaf is cast
        to the State's dtype where JAX would promote the two to it."""
        leaves, treedef = jax.tree_util.tree_flatten(value)
        got = None
        if treedef == self.treedef:
            with contextlib.suppress(TypeError):
                got = [_aval_of(x) for x in leaves]
        if got is None or any(g.shape != a.shape or g.dtype != a.dtype and not (
                g.weak_type and jnp.result_type(a.dtype, x) == a.dtype)
                for x, g, a in zip(leaves, got, self.avals)):
            expected = self.treedef.unflatten([a.str_short() for a in self.avals])
            shown = (treedef.unflatten([g.str_short() for g in got]) if got is not None
                     else f'a value of structure {treedef}')
            raise TraceContextError(
                f'{self.state._describe()} is written inside a nested JAX transformation, so '
                f'in this function it must keep its structure, shapes and dtypes {expected}; got '
                f'{shown}.  Cast or reshape the value before assigning it, or assign the State '
                'its new shape before calling the function')
        return [x if g.dtype == a.dtype else jax.lax.convert_element_type(x, a.dtype)
                for x, g, a in zip(leaves, got, self.avals)]


def _returned_inputs(body, carry) -> list:
    """Per output of ``body``, the input it returns unchanged, else None; a loop body's output k
    counts only as its own carry, input ``carry + k``."""
    at = {id(v): j for j, v in enumerate(body.invars)}
    return [j if j is not None and (carry is None or j == carry + k) else None
            for k, j in enumerate(at.get(id(v)) for v in body.outvars)]


def _forward_unchanged(jaxpr):
    """``jaxpr`` with uses of cond, loop and call outputs a body returns unchanged replaced by their
    operands, nested too: JAX's discharge threads a Ref only read there through, vmap batches."""
    sub, eqns, inner = {}, [], getattr(jaxpr, 'jaxpr', jaxpr)
    fwd = lambda v: sub.get(v, v) if isinstance(v, Var) else v   # noqa: E731
    nest = lambda v: (type(v)(map(nest, v)) if type(v) in (tuple, list) else   # noqa: E731
                      _forward_unchanged(v) if isinstance(v, (ClosedJaxpr, Jaxpr)) else v)
    for eqn in inner.eqns:
        if sub or _nested_jaxprs(eqn.params):   # (any other equation stays as it is)
            eqn = eqn.replace(invars=[fwd(v) for v in eqn.invars],
                              params={k: nest(v) for k, v in eqn.params.items()})
        bodies, operands, carry = _body_binding(eqn)
        ats = [_returned_inputs(b, carry) for b in bodies]
        if hoisted := _hoisted_scan(eqn, ats):   # reverse mode saves a carry once per step
            eqns += hoisted[0]
            sub.update(zip(eqn.outvars, hoisted[1], strict=True))
            continue
        for v, *at in zip(eqn.outvars, *ats, strict=True):
            if len(set(at)) == 1 and at[0] is not None:
                sub[v] = operands[at[0]]
        eqns.append(eqn)
    return _rebuild(inner, getattr(jaxpr, 'consts', None), eqns=eqns,
                    outvars=[fwd(v) for v in inner.outvars])


def _discharge_cells(closed: ClosedJaxpr, cells, picks) -> tuple:
    """``(jaxpr, consts, out_avals)``: ``closed`` made pure, its Ref inputs (``cells``) values,
    giving ``picks`` of its outputs, then of its Refs' final values (see _TraceFrame.finish)."""
    described = ', '.join(c.state._describe() for c in cells)
    # The hazards in each top-level equation, whose effects say which cells' Refs it writes.
    per_eqn = [(e, {_write_hazard(x) for x in itertools.chain(
        [e], *map(_all_eqns, _nested_jaxprs(e.params)))}) for e in closed.jaxpr.eqns]
    if 'condition' in (hazards := set().union(*(found for _, found in per_eqn))):
        raise TraceContextError(
            f'a lax.while_loop condition reads a State its body writes, among {described}; '
            'JAX would give that condition the value from before the loop.  Compute the '
            "condition from the loop carry instead (carry the State's value or the test)")
    if 'checkpoint' in hazards:
        raise _cannot('checkpoint', f'a State among {described}')
    refs = iter(v for v in closed.jaxpr.invars if _is_ref(v.aval))
    owned = [set(itertools.islice(refs, len(c.refs))) for c in cells]
    looping = set().union(*(_written_refs(e) for e, found in per_eqn if 'while' in found))
    if culprits := [c.state._describe() for c, own in zip(cells, owned, strict=True)
                    if c.linearized and own & looping or c.in_while]:
        raise _cannot('while', ', '.join(culprits))
    kept = set().union(*(_written_refs(e) for e in closed.jaxpr.eqns if _nested_jaxprs(e.params)))
    if lost := [c.state._describe() for c, own in zip(cells, owned, strict=True)
                if not kept & own and c.blind and not c.adopted]:   # JAX .. 0.5, grad / vjp
        raise _cannot('dropped', ', '.join(lost))
    if _drops_jvp_refs(closed.jaxpr):
        raise _cannot('tangent', ', '.join(c.state._describe() for c in cells if c.staged))
    try:
        pure = _discharge(closed)
    except Exception as err:
        if (kind := 'thread' if isinstance(err, NotImplementedError) else _refusal(err)) not in (
                'thread', 'varying'):
            raise
        raise _cannot(kind, described, err) from err
    jaxpr = _picked(_forward_unchanged(pure).jaxpr, picks, closed.jaxpr)
    every = [*(v.aval for v in closed.jaxpr.outvars), *(a.update(weak_type=w) for c in cells
                                                         for a, w in zip(c.avals, c.weak))]
    avals = [every[i] for i in picks]
    for before, after in zip(avals, jaxpr.outvars, strict=True):
        if (before.shape, before.dtype) != (after.aval.shape, after.aval.dtype):
            raise TraceContextError(
                f'a State among {described} changed shape inside a nested transformation '
                f'({before.str_short()} became {after.aval.str_short()}), e.g. by writing '
                'a per-lane value inside jax.vmap; map the function with StatefulMapping instead')
    if weak := {i: a.weak_type for i, (a, v) in enumerate(zip(avals, jaxpr.outvars))
                if a.weak_type != v.aval.weak_type}:   # lost in JAX's Refs, or its cond's pick
        run = _jaxpr_as_fun(_rebuild(jaxpr, pure.consts))
        retyped = lambda *xs: [x if i not in weak else _weakly(x) if weak[i] else
                               jax.lax.convert_element_type(x, x.dtype)
                               for i, x in enumerate(run(*xs))]
        traced, _, consts = _trace_to_jaxpr(retyped, [v.aval for v in jaxpr.invars], run, 'weak')
        return _rebuild(traced, None, debug_info=getattr(jaxpr, 'debug_info', None)), consts, avals
    return jaxpr, pure.consts, avals


# -- Tracing, and tracing again -----------------------------------------------
class _Redo(BaseException):
    """Aborts a run that is redone anyway: not an Exception, which the user's code between the
    abort and the trace's end may catch (a ``try`` around the write that aborts, say)."""


# The axis environment a run binds (``_fresh_epoch``): JAX keys its caches of traced bodies and
# jitted functions on it, so a FRESH run is isolated, SHARED runs share one axis, PLAIN binds none.
_Epoch = enum.Enum('_Epoch', 'PLAIN SHARED FRESH')


class _Lessons:
    """What earlier traces of one function teach its later ones (changed by _Retracer alone): the
    States lifted as Refs from their first touch, whether every run is isolated, and whether
    writes into a differentiation's Refs are tied to their old values."""
    __slots__ = ('ref_states', 'isolate', 'tie')

    def __init__(self):
        self.ref_states, self.isolate, self.tie = weakref.WeakSet(), False, False


class _Retracer:
    """Whether one trace's body runs again, and under which epoch: its frame reports what a run
    sees through the methods below, the only code that changes the run's or the lessons' fields.
    After a run that

    - read a State's concrete value in a body JAX may cache (``read_nested``), which stops it
      (``_Redo``), the next run is *isolated*, under a fresh epoch, as is every later trace; one
      that failed a write into Refs it improvised stops too and runs again;
    - met a tracer of a finished trace in a body JAX cached (UnexpectedTracerError, or tracer
      constants), the next run is isolated;
    - wrote a State inside a nested transformation (but directly in differentiations, where it is
      a local variable) that it had not lifted as Refs, or saw JAX refuse what such a local
      variable did (``wrote_unlifted``), or read one where the traces cannot tell which
      differentiations ended (``read_unknown_end``, which stops it), the next run lifts it as
      Refs from its first touch, as does every later trace (a refusal is told if it recurs),
      under the shared epoch if written in a body JAX may have cached with the old Refs
      (isolated if it was isolated);
    - saw JAX refuse a Ref program in which it lifted no State as Refs, the next run is
      isolated: a body JAX cached may hide the write it refuses;
    - saw JAX fail to transpose a loop writing a differentiation's Refs, the next run ties each
      such write to the Ref's old value (``_tied``), as does every later trace;
    - ran a nested function inline that raised an error its caller caught, or a refusal, or
      failed at its end after running one inline (``rerun_apart``), the next run and every later
      one of this trace runs each apart (``apart``; one may be made anew per run);
    - raised anything else, or did none of these, none follows: the error, or the result.

    A run writing a State a body traced before read (``wrote``) goes on isolated, so JAX traces
    such bodies again; a run is isolated while a State read by a plain JAX trace is alive
    (``_BAKED_STATES``): any cached jaxpr may hold it.
    """
    __slots__ = ('lessons', 'epoch', 'isolated', 'binding', 'pending', 'in_body', 'nested_reads',
                 'refused', 'aborted', 'inline_error', 'apart')

    def __init__(self, lessons: _Lessons):
        self.lessons, self.binding, self.refused = lessons, contextlib.ExitStack(), None
        self.apart = False   # (for every run of this trace: see next_run)
        self._start(_Epoch.FRESH if lessons.isolate else _Epoch.PLAIN)

    def _start(self, epoch: _Epoch) -> None:
        self.epoch = _Epoch.FRESH if _BAKED_STATES else epoch   # the run's; ``isolated``: now
        self.isolated, self.pending, self.in_body, self.nested_reads = False, set(), False, set()
        self.aborted, self.inline_error = False, None

    def _abort(self):   # (the run is redone even where the user's code catches the _Redo)
        self.aborted = True
        raise _Redo

    def bind(self) -> None:   # until unbind: the run's epoch (fresh inside a shared run)
        if self.epoch is _Epoch.SHARED and not _ctx.shared_epoch:
            self.binding.enter_context(_fresh_epoch(shared=True))
            self.binding.callback(setattr, _ctx, 'shared_epoch', False)
            _ctx.shared_epoch = True
        elif self.epoch is not _Epoch.PLAIN:
            self._isolate()

    def _isolate(self) -> None:
        self.binding.close()
        self.binding.enter_context(_fresh_epoch())
        self.isolated = True

    def unbind(self) -> None:
        self.binding.close()

    def read_nested(self, state, in_body: bool, concrete: bool) -> None:
        """A read inside a nested transformation: a body JAX may cache closes over it; a concrete
        value may be cached with that body for any later trace (the run stops unless isolated)."""
        if in_body:
            self.nested_reads.add(id(state))
        if concrete:
            self.lessons.isolate = True
            if in_body and not self.isolated:
                self._abort()

    def read_unknown_end(self, state) -> None:
        self.lessons.ref_states.add(state)
        self._abort()

    def wrote_unlifted(self, states, in_body: bool = False) -> None:
        self.pending.update(states)
        self.in_body |= in_body

    def inline_raised(self, err) -> None:
        """A nested call run inline raised ``err``; a refusal (one traced apart may do what this
        cannot) stops the run, as does any other caught (see next_run)."""
        self.inline_error = self.inline_error or err
        if isinstance(err, TraceContextError):
            self.apart = True
            self._abort()

    def rerun_apart(self, inlined) -> bool:
        """Whether a run that ``inlined`` nested functions and failed at its end runs again with
        them traced apart: each raises its own error from its call, where the caller may catch
        it."""
        if not inlined or self.apart:
            return False
        self.apart = True
        self._start(self.epoch)
        return True

    def wrote(self, state) -> None:
        if id(state) in self.nested_reads:
            self._isolate()
            self.nested_reads.clear()

    def next_run(self, err, consts, cells) -> bool:
        """Whether the body runs again after a run that raised ``err`` (None: none) or made a
        jaxpr closing over ``consts``; keeps the first refusal JAX gave, told should it recur."""
        lessons, epoch = self.lessons, self.epoch
        lessons.ref_states.update(self.pending)
        if _refusal(err) and not (self.refused and self.refused[1]):
            self.refused = err, cells
        if isinstance(err, _Redo) or self.aborted:
            epoch = _Epoch.FRESH if lessons.isolate else epoch
        elif self.inline_error not in (None, err) and not self.apart:
            self.apart = True   # (the error caught: what the call staged stays)
        elif epoch is not _Epoch.FRESH and (isinstance(err, jax.errors.UnexpectedTracerError)
                                            or any(isinstance(c, Tracer) for c in consts)):
            lessons.isolate, epoch = True, _Epoch.FRESH   # (or the caller's tracers: once)
        elif self.pending and (err is None or _refusal(err)):   # (a refusal of improvised Refs?)
            epoch = (_Epoch.FRESH if lessons.isolate else _Epoch.SHARED if self.in_body
                     else _Epoch.PLAIN)
        elif _refusal(err) == 'transpose' and not lessons.tie:   # (see _tied; a body JAX
            lessons.tie = lessons.isolate = True                 # cached is not tied)
            epoch = _Epoch.FRESH
        elif _refusal(err) and epoch is not _Epoch.FRESH and not self.refused[1]:
            epoch = _Epoch.FRESH   # (no State to name: an isolated run may show the write)
        else:
            return False
        self._start(epoch)
        return True

    def fail(self, err, cells):
        """Raises the error of the final run: JAX's refusal named by the States it concerns (for a
        cond's, those written in one; else in a body, else nested), the first if it recurred."""
        if _refusal(err) and self.refused:
            err, cells = self.refused
        kind = None if isinstance(err, TraceContextError) else _refusal(err)
        if kind is not None and cells:
            culprits = [c for c in cells if kind in ('cond', 'tangent') and c.in_cond]
            kind = 'cond' if culprits else 'effects' if kind == 'cond' else kind
            culprits = culprits or [c for c in cells if c.staged] or [c for c in cells if c.nested]
            named = sorted(c.state._describe() for c in culprits or cells)
            raise _cannot(kind, ', '.join(named), err) from err
        raise err


def _trace_stateful(fun: Callable, flat_avals: Sequence, rebuild: Callable, *,
                    name: str, return_only_write: bool, axis_env=None,
                    lift_aval: Callable | None = None, trace_with: Callable | None = None,
                    lessons: _Lessons | None = None) -> _Traced:
    """Traces ``fun(*args, **kwargs)``, ``(args, kwargs) = rebuild(flat)``, rerun as a _Retracer
    says; ``lift_aval(state, aval)`` may change a leaf's aval (StatefulMapping's lane shapes)."""
    retracer = _Retracer(_Lessons() if lessons is None else lessons)
    trace = trace_with or functools.partial(_trace_to_jaxpr, fun=fun, name=name)
    while True:
        frames, marks = [], [(c, len(c.states)) for c in _ctx.catchers]

        def flat_fun(*flat):
            frames.append(frame := _TraceFrame(name, retracer, lift_aval))
            with frame:
                args, kwargs = rebuild(list(flat))
                return frame.finish(fun(*args, **kwargs), return_only_write)

        _ctx.ntraces += 1
        with _axis_env(axis_env), _GcPause():
            try:
                (jaxpr, out_avals, consts), err = trace(flat_fun, flat_avals), None
            except (Exception, _Redo) as caught:
                err, consts = caught, ()
            again = retracer.next_run(err, consts, cells := frames[-1].cells if frames else ())
            if cells and not again and err is None:   # (collectives need the axes still bound)
                try:
                    jaxpr, consts, out_avals = _discharge_cells(
                        _rebuild(jaxpr, consts), cells, frames[-1].picks)
                    frames[-1].cells = None   # (the Ref jaxpr's tracers go before the gc resumes)
                except Exception:
                    if not (again := retracer.rerun_apart(frames[-1].inlined)):
                        raise
            if again:
                for catcher, n in marks:   # (a redone run's States were never made)
                    list(map(catcher.remove, catcher.states[n:]))
                continue
            if err is not None:
                retracer.fail(err, cells)
            traced = frames[-1].traced(_rebuild(jaxpr, consts), out_avals)
            StateTraceStack._hand_on(frames[-1], frames[-1].side)
            return traced


def _abstracted_tracer(abstracted_axes, split):
    """A ``trace_with`` for ``abstracted_axes`` via jax.make_jaxpr, the one dynamic-shape API."""
    _, dyn_args, _, dyn_kwargs = split
    if dyn_kwargs:
        raise NotImplementedError('abstracted_axes applies to positional arguments only; '
                                  'pass the dynamic arguments positionally')
    problem = _dynamic_shapes_problem(getattr(jax.config, 'jax_dynamic_shapes', None))
    if problem is not None:
        raise NotImplementedError(
            f'abstracted_axes cannot be honoured by JAX {jax.__version__} ({problem}).  Dynamic '
            "shapes need JAX 0.6 or older with jax.config.update('jax_dynamic_shapes', True); "
            'otherwise drop abstracted_axes and trace once per concrete shape')
    return _make_jaxpr_tracer(abstracted_axes, jax.tree_util.tree_structure(dyn_args))


def _make_jaxpr_tracer(abstracted_axes, treedef):
    """A ``trace_with`` through ``jax.make_jaxpr``, given arrays: dynamic shapes need them."""
    def trace_with(flat_fun, avals):
        examples = treedef.unflatten([jnp.zeros(a.shape, a.dtype) for a in avals])
        closed = jax.make_jaxpr(lambda *args: flat_fun(*_leaves(args)),
                                abstracted_axes=abstracted_axes)(*examples)
        return closed.jaxpr, closed.out_avals, closed.consts
    return trace_with


@functools.lru_cache(maxsize=None)
def _dynamic_shapes_problem(config):
    """Why abstracted_axes fails with states under this ``jax_dynamic_shapes``, or None."""
    probe_state = State(jnp.zeros(()))
    try:
        _trace_stateful(lambda x: x + probe_state.value, [ShapedArray((2,), jnp.float32)],
                        lambda flat: (flat, {}), name='probe', return_only_write=True,
                        trace_with=_make_jaxpr_tracer(('n',), jax.tree_util.tree_structure((0,))))
    except Exception as err:  # the probe only asks "does it work at all"
        return f'{type(err).__name__}: {err}'.strip()


# -- A trace's inputs and outputs in words ---------------------------------------
def _state_roles(traced) -> list:
    """``'read'``, ``'written'`` or ``'read and written'`` (its incoming value used) per state."""
    jaxpr = traced.closed_jaxpr.jaxpr
    used = {v for v in [*jaxpr.outvars, *(v for e in jaxpr.eqns for v in e.invars)]
            if isinstance(v, Var)}
    invars = iter(jaxpr.invars[len(jaxpr.invars) - sum(len(s[1]) for s in traced.state_sigs):])
    value_used = [any([next(invars) in used for _ in sig[1]]) for sig in traced.state_sigs]
    return [('read and written' if read else 'written') if written else 'read'
            for read, written in zip(value_used, traced.trace_stack.been_writen, strict=True)]


def _pretty(traced: _Traced, key) -> str:
    """``traced``'s jaxpr followed by a legend of its inputs and outputs."""
    jaxpr, text, keystr = traced.closed_jaxpr.jaxpr, str(traced.closed_jaxpr), jax.tree_util.keystr
    roles, args, seen = _state_roles(traced), _arg_labels(key), {}
    labels, state_of, in_roles = [], [], []
    for i, (s, sig) in enumerate(zip(traced.states, traced.state_sigs, strict=True)):
        base = s._name or type(s).__name__ + (   # else ``RandomState@model.py:12``; then ``#2``
            f'@{os.path.basename(s._source[0])}:{s._source[1]}' if s._source else '')
        seen[base] = n = seen.get(base, 0) + 1
        labels.append(base if n == 1 else f'{base}#{n}')
        for path in _leaf_paths(sig[0]):
            state_of.append((i, tuple(path)))   # (an output is unchanged from its own leaf)
            in_roles.append(f'state {labels[i]!r}{keystr(path)} ({type(s).__name__}), '
                            f'{roles[i]}, created at {s.source_info}')
    extra = len(jaxpr.invars) - len(args) - len(in_roles)   # abstracted_axes sizes
    in_roles = ['axis size (abstracted_axes)'] * extra + args + in_roles
    state_of_invar = dict(zip(jaxpr.invars[extra + len(args):], state_of, strict=True))
    out_roles = [f'result{keystr(path)}' for path in _leaf_paths(traced.out_tree)]
    for path, var in zip(_leaf_paths(traced.state_tree), jaxpr.outvars[traced.n_out:], strict=True):
        i = traced.returned[path[0].idx]
        unchanged = isinstance(var, Var) and state_of_invar.get(var) == (i, tuple(path[1:]))
        out_roles.append(f'state {labels[i]!r}{keystr(tuple(path[1:]))}: '
                         + ('returned unchanged' if unchanged else 'new value'))
    names_in, names_out = _jaxpr_names(text, len(jaxpr.invars), len(jaxpr.outvars))
    width = max([len(n) for n in names_in + names_out] + [1])
    awidth = max([len(v.aval.str_short()) for v in jaxpr.invars + jaxpr.outvars] + [1])
    lines = [text, '']
    for title, names, vars_, roles_ in [('inputs', names_in, jaxpr.invars, in_roles),
                                        ('outputs', names_out, jaxpr.outvars, out_roles)]:
        lines += [f'{title}:'] + [f'  {n:<{width}}  {v.aval.str_short():<{awidth}}  {r}'
                                  for n, v, r in zip(names, vars_, roles_, strict=True)]
    return '\n'.join(lines)


# =============================================================================
# 7. StatefulFunction
#
# A call must cost no more than a ``jax.jit`` call.  Each entry's plan gets one jitted dispatcher
# keyed by jax.jit's C++ cache; its miss re-enters ``_dispatch_body``, which inlines the entry's
# jaxpr (so a first call traces once, as jax.jit does).  Outside any trace a call takes the warm
# path or else the slow path, each a door whose executable is traced and compiled before it (a
# trace under its locks aborts: ``_Unprepared``); inside a stateful trace it joins that trace.
# =============================================================================

class _Unprepared(BaseException):
    """A trace or compile began under the locks of a call that expected its executable ready:
    the call lets go of them and prepares it first.  (Not an Exception: see _Redo.)"""


_real_value = operator.attrgetter('_value')     # a State's own value
_traced_value = operator.attrgetter('value')    # its value as the current trace sees it
_plan_tokens = itertools.count(1)
_MAX_PLAN_SWITCHES = 3   # plan switches after which a function stays on the slow path


class _Plan:
    """A plan (see the module's glossary), shared by the entries that agree, freed with the last."""
    __slots__ = ('token', 'states', 'write_states', 'write_index', 'written', 'donated', 'kept',
                 'locks', 'dispatchers', 'layouts', '__weakref__')

    def __init__(self, states, write_index, donate, written):
        self.token, self.states, self.write_index = next(_plan_tokens), states, write_index
        self.write_states = tuple(states[i] for i in write_index)
        self.written = tuple(map(set(written).__contains__, write_index))  # assigned, else returned
        self.donated = tuple(i for i in write_index if donate is not None and donate((), states[i]))
        self.kept = tuple(i for i in range(len(states)) if i not in self.donated)
        self.locks = tuple(_state_lock(x) for x in sorted(states, key=id))
        self.dispatchers, self.layouts = {}, {}   # jit by (token, nargs, donating); token by layout


class _Entry:
    __slots__ = ('traced', 'plan', 'apply', '_described', 'prepared')

    def __init__(self, traced, plan, apply, described):
        self.traced, self.plan, self.apply, self._described = traced, plan, apply, described
        self.prepared = set()   # the keys of the dispatchers compiled for it

    def described(self) -> _Traced:   # what the accessors describe
        if type(self._described) is not _Traced:   # (StatefulMapping's: built on first use)
            self._described = self._described()
        return self._described

    def run_writing(self, leaves, wrap=None):
        run = self.apply if wrap is None else wrap(self.apply)
        out, new = run([s.value for s in self.plan.states], leaves)
        for state, value, w in zip(self.plan.write_states, new, self.plan.written, strict=True):
            if w:   # (not one only returned: return_only_write=False)
                state.value = value
        return out


def _write_back(who, plan, new, warm: bool = False) -> None:
    """Gives ``plan``'s written States the values a compiled call of ``who`` returned; under a
    plain JAX trace, notes that the trace holds the values the call read (``_BAKED_STATES``).
    A ``warm`` call keeps layouts: its executable ran on the layouts the call that made it kept."""
    pairs = zip(plan.write_states, new, strict=True)
    if _under_jax_trace():
        _BAKED_STATES.update(plan.states)
        # Under a plain JAX transformation a write happens once per trace, not per
        # lane or derivative, and may leak a tracer: refused unless the State is local.
        pairs = [(s, v) for s, v, w in zip(plan.write_states, new, plan.written, strict=True) if w]
        if outer := [s._describe() for s, _ in pairs if s._creation_trace is not _current_trace()]:
            raise TraceContextError(
                f'{_who(who)} writes {", ".join(outer)} but was called inside a JAX '
                'transformation (jax.jit / jax.grad / jax.vmap ...) with no enclosing stateful '
                'trace, which cannot carry the new value out.  Wrap the outer function in '
                'StatefulFunction (or StatefulMapping), or thread the values with jaxpr_call.')
        for state, value in pairs:
            _check_tracers_may_enter(state, value, ())
    global _layout_epoch
    pairs = list(pairs)   # a layout the call gave anew: dispatchers keyed on the old go
    _layout_epoch += not warm and any([*map(_multi_device, _leaves(state._value))] != [
        *map(_multi_device, _leaves(value))] for state, value in pairs)   # (all before any is set)
    for state, value in pairs:
        state._value = value


def _name_deleted(err, states) -> None:
    """Where ``err`` is JAX's for a deleted buffer, raises naming the State among ``states``;
    where it may be about the compiled call's inputs, which JAX names by ``_dispatch_body``'s
    ``flat``, says which is which."""
    if _deleted_buffer(err):
        list(map(State.check_if_deleted, states))
    if isinstance(err, (ValueError, TypeError)):
        err.add_note(', '.join(f'flat[{i}]: {s._describe()}' for i, s in enumerate(states))
                     + f'; flat[{len(states)}] on: the arguments')


def _locked_call(who, plan, dispatch, args, kwargs, strict):
    """The door for a compiled call: ``plan``'s States held while read, run by ``dispatch``,
    written back; gives ``(out, values read)``.  ``strict``: see ``_dispatch_body``."""
    with _Door(who, _hold(who, plan.states, plan.locks, plan.write_states), strict):
        values = list(map(_real_value, plan.states))
        try:
            new, out = dispatch(*values, *args, **kwargs)
        except RuntimeError as err:   # (JAX's error for a deleted buffer names no State)
            _name_deleted(err, plan.states)
            raise
        _write_back(who, plan, new)
    return out, values


def _kept_layout(sf, state, new):
    """``new`` laid out like ``state``'s multi-device value, lest XLA gather it onto one, unless
    ``sf``'s ``keep_sharding`` leaves ``state`` out."""
    if not sf._keep((), state):
        return new

    def keep(old, value):
        sharding = _multi_device(old)
        same = sharding is not None and np.shape(old) == np.shape(value)
        return _laid_out(value, sharding) if same else value
    same_tree = jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state._value)
    return jax.tree_util.tree_map(keep, state._value, new) if same_tree else new


def _layout_token(plan) -> int:
    """``plan``'s dispatcher key for the layout its written states have now."""
    layout = tuple(_multi_device(leaf) for state in plan.write_states
                   for leaf in _leaves(state._value))
    return plan.layouts.setdefault(layout, next(_plan_tokens)) if any(layout) else plan.token


def _donating(sf, jitted, plan):
    """The donating ``jitted``, refusing an array two States share (JAX may crash on it)."""
    def checked(flat, kwargs):   # (the donated States first: an array one shares is named)
        owner, n = {}, len(plan.states)
        for i, value in [*((i, flat[i]) for i in plan.donated + plan.kept),
                         *enumerate([*flat[n:], kwargs], n)]:
            for leaf in _leaves(value):
                if isinstance(leaf, jax.Array) and (j := owner.setdefault(id(leaf), i)) != i and (
                        j in plan.donated):
                    raise ValueError(
                        f'{_who(sf)} would donate the array that {plan.states[j]._describe()} '
                        'and ' + (plan.states[i]._describe() if i < n else 'an argument')
                        + ' both hold; pass or give one of them a copy (jnp.copy), or leave the '
                        'State out of donate_states')
        return flat

    def call(*flat, **kwargs):
        try:
            return jitted(*checked(flat, kwargs), **kwargs)
        except BaseException as err:      # no State may keep a deleted buffer
            for state in (plan.states[i] for i in plan.donated if not _deleted_buffer(err)):
                if any(isinstance(x, jax.Array) and x.is_deleted() for x in _leaves(state._value)):
                    state._broken = _Broken(
                        RuntimeError, f'{state._describe()} has no value: its buffer was donated '
                        f'to a call of {_who(sf)} that then failed ({type(err).__name__}: {err}); '
                        'assign it a new value', 'buffer deleted by a failed donating call')
            raise
    call.lower = lambda *flat, **kwargs: jitted.lower(*checked(flat, kwargs), **kwargs)
    call._clear_cache = lambda: _forget_failed_calls(jitted)
    return call


def _typed_statics(jitted, positions, names):
    """``jitted`` given its static arguments as _StaticArgs, hashed with the types within: jax.jit
    may take a static (1, 2) for (1.0, 2), or a keyword's 1 for True, and run the program traced
    for the other (``positions``: in its flat arguments)."""
    def typed(flat, kwargs):
        flat = list(flat)
        for i in positions:
            flat[i] = flat[i] if type(flat[i]) is _StaticArg else _StaticArg(flat[i])
        return flat, {k: _StaticArg(v) if k in names else v for k, v in kwargs.items()}
    call = lambda *flat, **kwargs: (lambda f, k: jitted(*f, **k))(*typed(flat, kwargs))  # noqa
    call.lower = lambda *flat, **kwargs: (lambda f, k: jitted.lower(*f, **k))(*typed(flat, kwargs))
    call._clear_cache = lambda: _forget_failed_calls(jitted)
    return call


class _EagerCall(StateTraceStack):
    """The overlay of a call run eagerly (``_call_eagerly``); such calls take their locks one at a
    time, lest two take them in opposite orders."""
    one_at_a_time = threading.RLock()


# The warm path: the last slow call's plan and dispatcher while they apply (slots: read each call).
class _Fast:
    __slots__ = ('plan', 'dispatch', 'nargs', 'epoch', 'rules', 'states', 'locks', 'writes',
                 'leaf_type', 'hits', 'door')

    def __init__(self, sf, plan, dispatch, nargs, epoch, rules):
        self.plan, self.dispatch, self.nargs, self.epoch, self.rules, self.hits = (
            plan, dispatch, nargs, epoch, rules, sf._cache._hits)
        self.states, self.locks, self.writes = plan.states, plan.locks, plan.write_states
        self.door = _Door(sf, self.locks, strict=True)
        first = self.writes[0]._value if self.writes else None
        self.leaf_type = type(first) if getattr(first, 'aval', None) is not None else None


def _call(sf, *args, **kwargs):
    """``__call__``: the warm path where it still applies, its executable ready, else the slow
    path; a call in a trace joins it, one in recording stacks only is recorded there.  The warm
    path is a door: ``fast``'s every lock or none (then the long way), strict; values unlike the
    States' own at the first call (tracers) go through ``_write_back``."""
    __tracebackhide__ = True   # (pytest and IPython leave this frame out of tracebacks)
    if _frames_open and _ctx.frames:
        if type(overlay := _innermost_overlay(_ctx.frames)) is _EagerCall:
            return sf._call_eagerly(args, kwargs)
        return sf._call_slow(args, kwargs) if overlay is None else sf._call_in_trace(args, kwargs)
    if (fast := sf._fast) is None or fast.nargs != len(args) or fast.epoch != _layout_epoch or (
            fast.rules and _under_jax_trace()):   # (a custom rule serves no transformation)
        return sf._call_slow(args, kwargs)
    locks, doors = fast.locks, _ctx.doors
    try:
        for lock in locks:
            if not lock.acquire(False):   # one is busy: the long way
                for taken in locks[:locks.index(lock)]:
                    taken.release()
                out = _locked_call(sf, fast.plan, fast.dispatch, args, kwargs, True)[0]
                next(fast.hits)
                return out
        doors.append(fast.door)
        try:
            values = map(_real_value, fast.states)   # (jax.jit's fast path takes no **{})
            new, out = (fast.dispatch(*values, *args, **kwargs) if kwargs
                        else fast.dispatch(*values, *args))
            writes, traced = fast.writes, not _eager(_current_trace())
            if writes and type(new[0]) is fast.leaf_type and not traced:
                for state, value in zip(writes, new):   # (strict=True would slow each call)
                    state._value = value
            elif writes or traced:
                _write_back(sf, fast.plan, new, warm=True)
        finally:
            del doors[-1]
            for lock in locks:
                lock.release()
    except _Unprepared:   # a new signature: traced and compiled with no lock held
        _forget_failed_calls(fast.dispatch)
        return sf._call_slow(args, kwargs, fast.plan)
    except RuntimeError as err:
        _name_deleted(err, fast.states)
        raise
    except (TypeError, ValueError, OverflowError) as err:
        # An argument jax.jit refuses gets the slow path's clearer error here.
        # Anything else came from running the computation: never run it twice.
        sf._cache_key(args, kwargs)
        for state in fast.states:   # (one assigned a value JAX cannot take since: named)
            _reject_states(state._value, '', lambda err, path, leaf: TypeError(
                f'{state._describe()} holds {leaf!r} at value{path}, which is not a JAX type; '
                'assign it an array'))
        _name_deleted(err, fast.states)
        raise
    next(fast.hits)
    return out


class StatefulFunction:
    """Traces a function that reads and writes States into a cached ``ClosedJaxpr``.

    The jaxpr's inputs are the flat dynamic arguments, then every touched State in first-touch
    order; its outputs are the flat results, then the written States (all touched ones with
    ``return_only_write=False``).  Calls run compiled, one trace cached per argument signature,
    and write the new state values back.

    Parameters
    ----------
    static_argnums, static_argnames
        Compile-time constant arguments (negative positions count from the end; one named and
        passed by position is static too, as under ``jax.jit``).
    axis_env : sequence of (name, size), optional
        Named axes bound while tracing (for ``lax.axis_index`` / collectives).
    abstracted_axes : optional
        Dynamic-shape specification, on JAX releases that support it.
    donate_states : filter, optional
        Written states whose old buffers are donated, updated in place (``True``: all).
    keep_sharding : filter
        Written states spread over devices that keep their sharding (default: all).
    explain_cache_misses : bool, optional
        Log why each retrace happened (default: see :func:`explain_cache_misses`).

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

    _compiled_dispatch = True   # StatefulMapping over jax.pmap turns it off
    _traced_eagerly = False     # under jax.disable_jit(): StatefulMapping traces, then maps
    __call__ = _call

    def __init__(self, fun: Callable, static_argnums=(), static_argnames=(), axis_env=None,
                 abstracted_axes=None, name: str | None = None, return_only_write: bool = True, *,
                 donate_states=None, keep_sharding=True, explain_cache_misses: bool | None = None):
        """Checks every argument (an error names the bad one) and starts with an empty cache."""
        who, kind = _public_class(self), type(fun).__name__
        if isinstance(fun, (staticmethod, classmethod)):
            raise TypeError(f'{who}(fun) got a {kind} object, a descriptor; pass the function '
                            f'(obj.__func__) or apply the decorator outside @{kind}')
        if not callable(fun):
            raise TypeError(f'{who}(fun) needs a callable, got {kind}: {fun!r}')
        if any(f(fun) for f in (inspect.isgeneratorfunction, inspect.isasyncgenfunction,
                                inspect.iscoroutinefunction)):
            raise TypeError(f'{who} cannot trace {getattr(fun, "__qualname__", fun)!r}, a '
                            'generator or coroutine function (its body runs only when iterated '
                            'or awaited); make it a plain function that returns its value')
        self.fun, self.static_argnums = fun, _static_spec(static_argnums, 'static_argnums')
        self.static_argnames = _static_spec(static_argnames, 'static_argnames')
        self._named_at = () if self.static_argnums else _positions_of(fun, self.static_argnames)
        env = tuple(axis_env) if isinstance(axis_env, (list, tuple)) else axis_env
        for what, value, ok, want in (
                ('name', name, name is None or isinstance(name, str), 'a str or None'),
                ('return_only_write', return_only_write,
                 isinstance(return_only_write, (bool, np.bool_)), 'True or False'),
                ('axis_env', axis_env, not env or isinstance(env, tuple) and all(
                    isinstance(p, (list, tuple)) and len(p) == 2 and _is_int(p[1]) and p[1] > 0
                    for p in env), '(axis_name, size) pairs with int sizes >= 1')):
            if not ok:
                raise TypeError(f'{who}({what}=...) needs {want}, got {value!r}')
        self.axis_env, self.abstracted_axes = env or None, abstracted_axes
        self.name = name if name is not None else _name_of(fun)
        self.return_only_write = return_only_write
        self.donate_states, self.keep_sharding = donate_states, keep_sharding
        try:
            self._donate = None if donate_states in (None, False) else to_predicate(donate_states)
            self._keep = to_predicate(keep_sharding)
        except TypeError as err:
            raise TypeError(f'{who}(donate_states={donate_states!r}, keep_sharding='
                            f'{keep_sharding!r}): {err}') from None
        if abstracted_axes is not None and not _MAKE_JAXPR_HAS_ABSTRACTED_AXES:
            raise NotImplementedError(
                f'abstracted_axes is not supported by the installed JAX {jax.__version__}: '
                'dynamic shapes were removed from jax.make_jaxpr in 0.8.2; drop '
                'abstracted_axes and trace once per concrete shape')
        if (flag := explain_cache_misses) is not None and not isinstance(flag, (bool, np.bool_)):
            raise TypeError('explain_cache_misses must be True, False or None (None follows '
                            f'stateful_jaxpr.explain_cache_misses()), got {flag!r}')
        self.explain_cache_misses = None if flag is None else bool(flag)
        self._cache, self._lessons, self._guard = BoundedCache(128), _Lessons(), threading.Lock()
        self.clear_cache()
        functools.update_wrapper(self, fun, updated=())

    def clear_cache(self) -> None:
        """Drops every cached trace and compiled executable (and the statistics)."""
        self._cache.clear()
        self._miss_causes = collections.Counter()   # why traces happened (_note_miss)
        self._key_locks = weakref.WeakValueDictionary()   # per key; weak: evicted keys go
        self._plans = weakref.WeakValueDictionary()            # the entries' plans, by key
        self._fast, self._plan_switches = None, 0   # a _Fast; see _call_slow

    # -- entries -----------------------------------------------------------------
    def _cache_key(self, args, kwargs):
        """``(key, leaves, (static_args, dyn_args, static_kwargs, dyn_kwargs))``, clear errors."""
        statics = _static_positions(self, len(args))
        static_args = tuple((i, args[i]) for i in statics)
        dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)
        static_kwargs = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        static_key = tuple((i, _hash_static(self, f'positional argument {i}', v))
                           for i, v in static_args)
        static_kw_key = tuple(sorted((k, _hash_static(self, f'keyword argument {k!r}', v))
                                     for k, v in static_kwargs.items()))
        leaves_a, tree_a = jax.tree_util.tree_flatten(dyn_args)
        leaves_k, tree_k = jax.tree_util.tree_flatten(dyn_kwargs)
        try:
            sigs_a, sigs_k = tuple(map(_leaf_sig, leaves_a)), tuple(map(_leaf_sig, leaves_k))
        except (TypeError, OverflowError):
            _explain_bad_leaves(self, dyn_args, dyn_kwargs)
            raise
        key = hashabledict(static_args=static_key, dyn_args=(tree_a, sigs_a),
                           static_kwargs=static_kw_key, dyn_kwargs=(tree_k, sigs_k))
        return key, leaves_a + leaves_k, (static_args, dyn_args, static_kwargs, dyn_kwargs)

    def _cached(self, key, read, plan=None):
        """The entry under ``key`` (for ``plan``) traced for the types ``read(state)`` gives, among
        the last few traced for it (a State may move between meshes and back); one keeping a
        custom rule serves only our dispatcher's jit (``plan``): its rule's lazily traced jaxprs
        close over what the first trace saw, States too."""
        settings = (entries := self._cache._peek(key, ())) and _settings()
        for entry in entries:
            if (plan is None or entry.plan is plan) and entry.traced.settings == settings and not (
                    entry.traced.rules and plan is None and _under_jax_trace()) and all(
                    _stale_sig(read(state), sig, True) is None for state, sig in zip(
                        entry.plan.states, entry.traced.state_sigs, strict=True)):
                return entry
        return None

    def _entry_for(self, key, leaves, split, *, count: bool, read=_real_value):
        """The valid entry for ``key``, tracing (once per key, under its lock) when needed."""
        entry = hit = self._cached(key, read)
        if entry is None:
            with self._guard:
                lock = self._key_locks.setdefault(key, threading.RLock())
            with lock:
                entry = hit = self._cached(key, read)
                if entry is None:
                    plans = self._plans   # (swapped by clear_cache: a trace it raced is not kept)
                    held, entry = self._cache._peek(key, ()), self._build_entry(key, leaves, split)
                    self._note_miss(key, held, entry)
                    # (a rule traced under a JAX trace must not reach our dispatcher: see _cached)
                    if entry.traced.cacheable and not (entry.traced.rules and _under_jax_trace(
                            )) and plans is self._plans:
                        self._cache._store(key, (entry, *held[:3]))
        if count:
            self._cache._record(hit is not None)
        return entry

    def _note_miss(self, key, stale, entry) -> None:
        """Counts why it traced for ``key`` (``stale``: the entries it has), logs if asked."""
        cached = [(key, stale)] if stale else self._cache._items()
        first, near = not self._miss_causes, None
        if first:
            found = [('first trace', '')]
        elif cached:   # the nearest: the fewest differences, ties to the most recent (listed last)
            labels = _arg_labels(key)
            near, old, found = min([(k, old, _key_differences(k, key, labels))
                                    for k, old in reversed(cached)], key=lambda c: len(c[2]))
            found = found + min([_state_differences(e.traced, entry.traced) for e in old], key=len)
            if not found and entry.traced.rules and _under_jax_trace():   # (see _cached)
                found = [('custom rule', 'a custom_vjp / custom_jvp rule: an entry keeping one '
                          'serves only compiled calls, so each under a JAX transformation traces')]
        else:
            found = [('no cached entry', 'no entry is cached (cleared, evicted or not '
                                         f'cacheable; cache_size={self._cache.maxsize})')]
        with self._guard:   # (a Counter's update is no single step)
            self._miss_causes.update(list(dict.fromkeys(c for c, _ in found)) or ['unknown'])
        enabled = self.explain_cache_misses
        if first or not (_explain_default[0] if enabled is None else enabled):
            return
        lines = '\n'.join(f'  - {line}' for _, line in found if line) or \
            '  - nothing the cache key or the States show (the entry was not cacheable)'
        changed = ' and '.join(dict.fromkeys(
            'a JAX setting' if cause == 'jax setting' else 'its States' for cause, _ in found
            if cause != 'custom rule'))
        logging.getLogger(__name__).warning(
            '%s(%r) traced again for (%s).\nNearest cached entry: %s%s\nWhat differs:\n%s',
            _public_class(self), self.name, _key_summary(key),
            'none' if near is None else f'({_key_summary(near)})',
            f' (the same arguments; {changed} changed)' if stale and changed else '', lines)

    def _build_entry(self, key, leaves, split) -> _Entry:
        """Traces ``fun`` for these arguments into an entry whose ``apply`` runs the jaxpr."""
        dynamic = self.abstracted_axes is not None
        trace_with = _abstracted_tracer(self.abstracted_axes, split) if dynamic else None
        traced = _trace_stateful(self.fun, [_aval_of(x) for x in leaves], _rebuilder(split),
                                 name=self.name, return_only_write=self.return_only_write,
                                 axis_env=self.axis_env, trace_with=trace_with,
                                 lessons=self._lessons)
        apply = traced.runner(self.name if self._compiled_dispatch else None)

        def refuse(*_):   # (a dynamic-shape jaxpr)
            raise NotImplementedError(
                f'{_who(self)} was built with abstracted_axes: its dynamic-shape jaxpr is '
                'for inspection (make_jaxpr / get_jaxpr) only; drop abstracted_axes to call it')
        written = tuple(i for i, w in enumerate(traced.trace_stack.been_writen) if w)
        return _Entry(traced, self._plan_for(traced.states, traced.returned, written),
                      refuse if dynamic else apply, traced)

    @_api_boundary
    def _lookup(self, args, kwargs, count: bool = True, read=_real_value):
        """``(key, entry, flat args)`` for a call, traced if needed (``count``-ed as a call)."""
        key, leaves, split = self._cache_key(args, kwargs)
        return key, self._entry_for(key, leaves, split, count=count, read=read), leaves

    def _plan_for(self, states, write_index, written=None) -> _Plan:
        written = write_index if written is None else written
        plan_key = (tuple(map(id, states)), write_index, written)
        if (plan := self._plans.get(plan_key)) is None:
            plan = self._plans[plan_key] = _Plan(states, write_index, self._donate, written)
        return plan

    # -- compiled calls ------------------------------------------------------------
    def _dispatcher(self, plan, token: int, nargs: int, donating: bool = False):
        """One jax.jit per plan and layout, held by the plan: saves hashing it as static."""
        if (jitted := plan.dispatchers.get((token, nargs, donating))) is None:
            statics = tuple(i + len(plan.states) for i in _static_positions(self, nargs))
            jitted = jax.jit(functools.partial(self._dispatch_body, weakref.ref(plan), token),
                             static_argnums=statics,
                             static_argnames=self.static_argnames or None,
                             donate_argnums=plan.donated if donating else ())
            if donating:
                jitted = _donating(self, jitted, plan)
            if statics or self.static_argnames:
                jitted = _typed_statics(jitted, statics, self.static_argnames)
            plan.dispatchers[(token, nargs, donating)] = jitted
        return jitted

    def _dispatch_body(self, plan_ref, token, *flat, **kwargs):
        """Traced by jax.jit on a dispatcher miss, which under a strict door (the warm path's) it
        aborts; takes the States' values first, one argument each (then jax.jit's fast path
        flattens no list); a negative token (jaxpr_call) keeps no layout."""
        if token > 0 and (doors := _ctx.doors) and doors[-1].who is self and doors[-1].strict and (
                jax.config.jax_disable_jit or not _eager(_current_trace())):
            raise _Unprepared   # (run eagerly otherwise: jax_debug_nans' rerun, as jax.jit's)
        plan = plan_ref()   # (weak, as the plan holds this jax.jit; the caller holds the plan)
        state_values, args = flat[:len(plan.states)], flat[len(plan.states):]
        args = tuple(a.value if isinstance(a, _StaticArg) else a for a in args)
        kwargs = {k: v.value if isinstance(v, _StaticArg) else v for k, v in kwargs.items()}
        key, leaves, split = self._cache_key(args, kwargs)
        given = dict(zip(map(id, plan.states), state_values, strict=True))
        entry = self._cached(key, lambda state: given[id(state)], plan)
        if entry is None:   # a State changed shape since the caller looked its entry up
            if (entry := self._entry_for(key, leaves, split, count=False)).plan is not plan:
                raise _Unprepared
        out, new = entry.apply(list(state_values), leaves,   # (eager: jax_debug_nans' rerun)
                               'eager' if _eager(_current_trace()) else 'whole')
        return tuple(self._laid_out_as_held(plan, new, token)), out   # (the order: see _run)

    def _laid_out_as_held(self, plan, new, token) -> list:   # (token: see _layout_token)
        if not 0 < token != plan.token:   # (plan.token: no written State spans devices)
            return list(new)
        return [_kept_layout(self, s, v) for s, v in zip(plan.write_states, new, strict=True)]

    def _run(self, entry, state_values, args, kwargs, leaves, token, lower=False):
        """Runs ``entry`` (``lower``: compiles it only): ``(new state values, out)``, the States
        first, as jax.jit gives a donated buffer to the first output of its type; a negative
        ``token`` (``jaxpr_call``) donates and lays out nothing."""
        if not self._compiled_dispatch or not entry.traced.cacheable or (
                entry.traced.rules and _under_jax_trace()):   # (see _cached)
            if lower:
                return None
            out, new = entry.apply(state_values, leaves)
            return self._laid_out_as_held(entry.plan, new, token), out
        plan = entry.plan
        jitted = self._dispatcher(plan, token, len(args), token > 0 and bool(plan.donated))
        try:
            return (_compile_ahead(jitted.lower(*state_values, *args, **kwargs)) if lower
                    else jitted(*state_values, *args, **kwargs))
        except (ValueError, TypeError) as err:
            _name_deleted(err, plan.states)
            raise

    @_api_boundary
    def _call_slow(self, args, kwargs, warm_plan=None):
        """A call the long way: the entry traced and its executable compiled with no State lock
        held, then run through the door (strict; should that miss the executable, once more, not
        strict); the warm path from then on.  ``warm_plan``: the warm path's, which missed."""
        if jax.config.jax_disable_jit and not _under_jax_trace():
            return self._call_eagerly(args, kwargs)
        ntraces, strict, epoch, plans = _ctx.ntraces, not _under_jax_trace(), None, self._plans

        def run(*values):   # the layout as the States have it under the locks
            nonlocal epoch, token
            epoch, token = _layout_epoch, _layout_token(plan)
            return self._run(entry, values, args, kwargs, leaves, token)
        while True:
            _, entry, leaves = self._lookup(args, kwargs, count=False)
            plan, token = entry.plan, _layout_token(entry.plan)
            key = (token, len(args), bool(plan.donated))
            if strict and (warm_plan is not None or key not in entry.prepared):
                with contextlib.suppress(_Unprepared):
                    self._run(entry, list(map(_real_value, plan.states)), args, kwargs, leaves,
                              token, lower=True)
                entry.prepared.add(key)
            try:
                out, values = _locked_call(self, plan, run, (), {}, strict)
                break
            except _Unprepared:   # (rare) prepared for other values
                _forget_failed_calls(self._dispatcher(plan, token, *key[1:]))
                strict = False
        for i, frame in enumerate(_ctx.frames):   # recording stacks see what the call touched
            for touched in zip(plan.states, values, entry.traced.trace_stack.been_writen,
                               strict=True):
                if i >= touched[0]._stack_level:   # (see _touch_all)
                    frame._touch(*touched)
        self._plan_switches += warm_plan is not None and plan is not warm_plan
        warm = (self._compiled_dispatch and entry.traced.cacheable
                and self._plan_switches < _MAX_PLAN_SWITCHES)
        self._fast = _Fast(self, plan, self._dispatcher(plan, token, *key[1:]), len(args), epoch,
                           entry.traced.rules) if warm else None
        if plans is not self._plans:   # cleared since (it clears _fast last): no warm path left
            self._fast = None
        self._cache._record(_ctx.ntraces == ntraces)
        return out

    def _call_eagerly(self, args, kwargs):
        """Under ``jax.disable_jit()`` runs the body as Python, as jax.jit and jax.vmap do, in an
        _EagerCall overlay (which a call nested in it joins) holding each State from its first
        touch: the writes reach the States at the end, together, as a compiled call's do."""
        key, leaves, split = self._cache_key(args, kwargs)   # the usual argument checks
        entry = self._build_entry(key, leaves, split) if self._traced_eagerly else None

        def run():
            out = self.fun(*args, **kwargs) if entry is None else entry.run_writing(leaves)
            _reject_states(out, 'the function returned ')
            return out
        if type(outer := _innermost_overlay(_ctx.frames)) is _EagerCall:
            return outer._attempt(run)   # (its writes undone, as a failed compiled call's are)

        def lift(state):   # the door, at the first touch
            door.locks.extend(_hold(self, (state,), (_state_lock(state),), (state,)))
            return state._value
        with _Door(self, []) as door:
            with _EagerCall.one_at_a_time, _EagerCall(lift, self.name) as frame:
                try:
                    out, values = run(), frame._values
                except RuntimeError as err:
                    _name_deleted(err, frame.states)
                    raise
            written = frame.get_write_states()
            for state in written:
                _refuse_non_jax(state, values[id(state)], self.name)
            new = [_kept_layout(self, state, values[id(state)]) for state in written]
            _store_all(list(zip(written, new)))   # (held by this call)
        return out

    def _call_in_trace(self, args, kwargs, wrap=None):
        """A call inside an enclosing stateful trace, which threads states through ``value``;
        ``wrap`` (e.g. jax.checkpoint) transforms the entry's pure form.  A first call made
        directly in that trace, with traced arguments and no entry cached, runs inline, as its
        body written there would: a trace of its own lifts each State it touches once more per
        level.  Later calls in the trace bind one entry."""
        ntraces, frame = _ctx.ntraces, _innermost_overlay(_ctx.frames)
        key, leaves, split = self._cache_key(args, kwargs)
        if wrap is None and type(frame) is _TraceFrame and type(self) is StatefulFunction and (
                _current_trace() is frame._jax_trace and id(self) not in frame.inlined
                and self.axis_env is None is self.abstracted_axes
                and not frame.retracer.apart
                and all(isinstance(x, Tracer) for x in leaves)
                and self._cached(key, _traced_value) is None):
            frame.inlined.add(id(self))   # (its arguments rebuilt, as a trace of its own has)
            return frame.inline(self.name, self.fun, *_rebuilder(split)(leaves))
        entry = self._entry_for(key, leaves, split, count=False, read=_traced_value)
        out = entry.run_writing(leaves, wrap)
        self._cache._record(_ctx.ntraces == ntraces)
        return out

    # -- cache management ----------------------------------------------------------
    def get_cache_stats(self) -> dict:
        """The entry cache's ``get_stats()`` under brainstate's four cache names."""
        stats = self._cache.get_stats()
        return {name: dict(stats) for name in
                ('jaxpr_cache', 'out_shapes_cache', 'jaxpr_out_tree_cache', 'state_trace_cache')}

    def get_miss_causes(self) -> dict:
        """``{cause: traces}`` since ``clear_cache()`` (see :func:`explain_cache_misses`)."""
        return dict(self._miss_causes)

    # -- brainstate 0.2.1's accessors (its names, signatures, return types): what entries describe.
    def _described_by_key(self, key, context: str) -> _Traced:   # for the States as they are
        held = self._cache.get(key, raise_on_miss=True, error_context=context)
        return (self._cached(key, _real_value) or held[0]).described()

    def _described_for(self, args, kwargs, compile_if_miss: bool, context: str) -> _Traced:
        return (self._lookup(args, kwargs)[1].described() if compile_if_miss
                else self._described_by_key(self._cache_key(args, kwargs)[0], context))

    def get_jaxpr(self, *args, compile_if_miss: bool = True, **kwargs):
        """The ClosedJaxpr for these arguments."""
        return self._described_for(args, kwargs, compile_if_miss, 'JAX expression').closed_jaxpr

    def get_jaxpr_by_cache(self, cache_key):
        """:meth:`get_jaxpr` for a cache key."""
        return self._described_by_key(cache_key, 'JAX expression').closed_jaxpr

    def get_out_shapes(self, *args, compile_if_miss: bool = True, **kwargs):
        """``(out_shapes, state_shapes)`` as ``jax.ShapeDtypeStruct`` pytrees; ``state_shapes``
        has one entry per state (``get_states()`` order), ``None`` where not returned."""
        return self._described_for(args, kwargs, compile_if_miss, 'Output shapes').out_shapes()

    def get_out_shapes_by_cache(self, cache_key):
        """:meth:`get_out_shapes` for a cache key."""
        return self._described_by_key(cache_key, 'Output shapes').out_shapes()

    def get_out_treedef(self, *args, compile_if_miss: bool = True, **kwargs):
        """The structure of ``(out, state_part)``: ``unflatten(jaxpr_outputs)`` gives both."""
        return self._described_for(args, kwargs, compile_if_miss, 'Output tree').full_tree

    def get_out_treedef_by_cache(self, cache_key):
        """:meth:`get_out_treedef` for a cache key."""
        return self._described_by_key(cache_key, 'Output tree').full_tree

    def get_state_trace(self, *args, compile_if_miss: bool = True, **kwargs):
        """The :class:`StateTraceStack` recorded while tracing."""
        return self._described_for(args, kwargs, compile_if_miss, 'State trace').trace_stack

    def get_state_trace_by_cache(self, cache_key):
        """:meth:`get_state_trace` for a cache key."""
        return self._described_by_key(cache_key, 'State trace').trace_stack

    def get_states(self, *args, compile_if_miss: bool = True, **kwargs):
        """Every touched State, in jaxpr-input order."""
        return self._described_for(args, kwargs, compile_if_miss, 'State trace').states

    def get_states_by_cache(self, cache_key):
        """:meth:`get_states` for a cache key."""
        return self._described_by_key(cache_key, 'State trace').states

    def get_read_states(self, *args, compile_if_miss: bool = True, **kwargs):
        """The touched States that are only read."""
        return self.get_state_trace(*args, compile_if_miss=compile_if_miss,
                                    **kwargs).get_read_states()

    def get_read_states_by_cache(self, cache_key):
        """:meth:`get_read_states` for a cache key."""
        return self.get_state_trace_by_cache(cache_key).get_read_states()

    def get_write_states(self, *args, compile_if_miss: bool = True, **kwargs):
        """The touched States that are written."""
        return self.get_state_trace(*args, compile_if_miss=compile_if_miss,
                                    **kwargs).get_write_states()

    def get_write_states_by_cache(self, cache_key):
        """:meth:`get_write_states` for a cache key."""
        return self.get_state_trace_by_cache(cache_key).get_write_states()

    def get_arg_cache_key(self, *args, compile_if_miss: bool = False, **kwargs) -> hashabledict:
        """The hashable cache key for these arguments (traces first if asked)."""
        return (self._lookup if compile_if_miss else self._cache_key)(args, kwargs)[0]

    def jaxpr_call_auto(self, *args, **kwargs):
        """Reads the states, runs, writes the written ones back; returns the output."""
        return self(*args, **kwargs)

    def validate_states(self, cache_key) -> bool:
        """``True`` if the entry's states still have their traced shapes, else ``ValueError``."""
        described = self._described_by_key(cache_key, 'State trace')
        for state, sig in zip(described.states, described.state_sigs, strict=True):
            if (got := _stale_sig(state._value, sig)) is not None:
                raise ValueError(f'{state._describe()} changed from {sig} to {got} since it was '
                                 'traced; the next call retraces (or call clear_cache())')
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

    # -- public API --------------------------------------------------------------
    def make_jaxpr(self, *args, **kwargs) -> 'StatefulFunction':
        """Traces for these arguments on a cache miss; returns ``self``."""
        self._lookup(args, kwargs)
        return self

    def jaxpr_call(self, state_vals: Sequence, *args, **kwargs):
        """Pure call, under any JAX transformation: ``(new_state_vals, out)``.

        Both state sequences hold one value per touched state in ``get_states()``
        order; ``new_state_vals`` has ``None`` for a state the jaxpr does not return.

        Example
        -------
        >>> s = State(jnp.zeros(()))
        >>> def f(x):
        ...     s.value = s.value + x
        ...     return x
        >>> new_vals, out = StatefulFunction(f).jaxpr_call([jnp.ones(())], 2.0)
        >>> float(new_vals[0]), float(s.value)      # s itself is untouched
        (3.0, 0.0)
        """
        try:
            state_vals = list(state_vals)
        except TypeError:
            raise TypeError(f'{_who(self)}.jaxpr_call(state_vals, ...) needs a sequence of state '
                            f'values in get_states() order, got {state_vals!r}') from None
        _reject_states(state_vals, f'{_who(self)}.jaxpr_call: state_vals', lambda e, path, leaf:
                       ValueError(f'{_who(self)}.jaxpr_call: state_vals{path} is not a JAX type '
                                  f'({e}); pass arrays, one pytree of them per State'))
        # Traced for the values given: by a cached entry's States, else by first touch, in order.
        held = self._cache._peek(self._cache_key(args, kwargs)[0], ())
        states, order = (held[0].described().states if held else ()), iter(state_vals)
        for retry in (False, True):
            given = dict(zip(map(id, states), state_vals))
            read = lambda s: given.get(id(s), s._value)   # noqa: E731
            with StateTraceStack(new_arg=read if given else lambda s: next(order, s._value)):
                _, entry, leaves = self._lookup(args, kwargs, not retry, read)
            described = entry.described()
            if len(state_vals) != len(states := described.states):
                raise ValueError(
                    f'State length mismatch: {_who(self)} touches {len(states)} state(s) ('
                    f'{", ".join(s._label() for s in states)}) but jaxpr_call got '
                    f'{len(state_vals)} value(s); pass one value per state in get_states() order')
            stale = list(map(_stale_sig, state_vals, described.state_sigs, itertools.repeat(True)))
            if not any(stale):
                break
        else:   # (still other: a State touched in another order for the values given)
            got, sig, state = next(c for c in zip(stale, described.state_sigs, states) if c[0])
            raise ValueError(f'jaxpr_call: the value given for {state._describe()} is '
                             f'{_value_text(got)}, traced as {_value_text(sig)}; pass '
                             'values in get_states() order')
        # The compiled call takes them in plan order; returned states not written come back as given
        where = {id(st): i for i, st in enumerate(states)}
        at = [where[id(st)] for st in entry.plan.states]
        # A custom rule JAX traces now reads the States as given, not as they are.
        rules = entry.traced.rules and _under_jax_trace()
        with StateTraceStack(new_arg=lambda s: state_vals[where[id(s)]] if id(s) in where
                             else _baked(s)) if rules else contextlib.nullcontext():
            new, out = self._run(entry, [state_vals[i] for i in at], args, kwargs, leaves,
                                 -entry.plan.token)
        returned = set(described.returned)
        new_vals = [v if i in returned else None for i, v in enumerate(state_vals)]
        for j, value in zip(entry.plan.write_index, new, strict=True):
            new_vals[at[j]] = value
        return tuple(new_vals), out

    def pretty_jaxpr(self, *args, **kwargs) -> str:
        """The jaxpr for these arguments and a legend naming each input and output:
        an argument by pytree path, a State by name, use and creation site, a result
        by its path.  ``str(sf)`` shows the same for the latest entry.

        Example
        -------
        >>> w = State(jnp.ones(2), name='w')
        >>> def f(x):
        ...     w.value = w.value * x['scale']
        ...     return w.value.sum()
        >>> text = StatefulFunction(f).pretty_jaxpr({'scale': 2.0})
        >>> print(text[text.index('inputs:'):text.index('outputs:')])
        inputs:
          a  float32[]   argument 0['scale']
          b  float32[2]  state 'w' (State), read and written, created at ...
        """
        key, entry, _ = self._lookup(args, kwargs)
        return _pretty(entry.described(), key)

    def __str__(self):
        keys = self._cache.keys()
        if not (entries := self._cache._peek(keys[-1]) if keys else None):
            return f'{self!r}, not traced yet'
        return (f'{self!r}, last traced for ({_key_summary(keys[-1])}):\n'
                + _pretty(entries[0].described(), keys[-1]))

    def __repr__(self):
        return f'{_public_class(self)}({self.name!r}, entries={len(self._cache)})'


def make_jaxpr(fun: Callable, static_argnums=(), static_argnames=(), axis_env=None,
               return_shape: bool = False, abstracted_axes=None,
               return_only_write: bool = False, pretty: bool = False) -> Callable:
    """Like ``jax.make_jaxpr``, with the States the function touches as inputs and outputs.

    The returned function gives ``(closed_jaxpr, states)``, with ``return_shape=True`` also
    ``out_shapes``, with ``pretty=True`` the labelled text of :meth:`StatefulFunction.pretty_jaxpr`
    instead.  For a function that touches no State the jaxpr equals ``jax.make_jaxpr``'s.

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
    sf = StatefulFunction(fun, static_argnums, static_argnames, axis_env, abstracted_axes,
                          return_only_write=return_only_write)
    if pretty and return_shape:
        raise ValueError('make_jaxpr(pretty=True) returns the labelled jaxpr text, which has '
                         'no place for out_shapes; pass return_shape=True or pretty=True')

    @functools.wraps(fun)
    def make(*args, **kwargs):
        if pretty:
            return sf.pretty_jaxpr(*args, **kwargs)
        traced = sf._lookup(args, kwargs)[1].traced
        shapes = (traced.out_shapes()[0],) if return_shape else ()
        return (traced.closed_jaxpr, traced.states, *shapes)
    return make


# =============================================================================
# 8. grad and checkpoint
#
# ``jax.grad`` with respect to States (brainstate's ``transform.grad``), over StatefulFunction.
# The traced program takes every State as an input, so one written in a loop body is a carry
# there and jax.grad backpropagates through all its steps on every release.  ``checkpoint``
# hands JAX's rematerialization the pure form, the States read before it and written after.
# =============================================================================

def _check_grad_states(inner, uniq, touched, check_states: bool, allow_int: bool) -> None:
    """Refuses a grad State ``inner`` never touches, or one holding non-float values."""
    missing = [s._describe() for s in uniq if s not in touched and check_states]
    ints = [s._describe() for s in uniq if not allow_int and not all(
        jnp.issubdtype(_aval_of(x).dtype, jnp.inexact) for x in _leaves(s.value))]
    if missing or ints:
        raise (ValueError if missing else TypeError)(
            f'grad of {_who(inner)}: {", ".join(missing or ints)}, given in grad_states, ' + (
                'is never touched by it; drop it, or pass check_states=False for a zero gradient'
                if missing else 'holds non-float values; pass allow_int=True for float0 gradients'))


def _grad_targets(grad_states, argnums) -> tuple:
    """``(states, tree, argnums)``: the States in ``grad_states``'s order and its structure,
    and the argument numbers as a tuple (None: no argument gradients)."""
    pairs, tree = jax.tree_util.tree_flatten_with_path(   # (a dict of any kind: a dict, as
        dict(grad_states) if isinstance(grad_states, dict) else grad_states,   # brainstate's)
        is_leaf=lambda x: isinstance(x, State))
    for path, x in pairs:
        if not isinstance(x, State):
            raise TypeError(f'grad(grad_states=...) takes States, but grad_states'
                            f'{jax.tree_util.keystr(path)} is {x!r}; pass the State itself')
    nums = (0,) if argnums is None and not pairs else (argnums,) if _is_int(argnums) else argnums
    if not (nums is None or isinstance(nums, (tuple, list)) and all(map(_is_int, nums))):
        raise TypeError(f'grad(argnums=...) takes an int or a sequence of ints, got {argnums!r}')
    return [leaf for _, leaf in pairs], tree, nums


def grad(fun: Callable | None = None, grad_states=None, argnums=None, holomorphic: bool = False,
         allow_int: bool = False, has_aux: bool | None = None, return_value: bool = False, *,
         check_states: bool = True) -> StatefulFunction:
    """``jax.grad`` of ``fun``'s scalar result with respect to States and arguments.

    A call returns the gradients of ``grad_states`` (a State, or a sequence or dict of them, in
    that structure), or of the arguments ``argnums`` (as ``jax.grad``'s; 0 without States), or
    ``(state_grads, arg_grads)`` given both; then the loss with ``return_value``; then ``aux``
    with ``has_aux`` (``fun`` returns ``(loss, aux)``).  States ``fun`` writes end as it left
    them.  A grad State it never touches is a ValueError, or with ``check_states=False`` gets a
    zero gradient.  A StatefulFunction; without ``fun``, a decorator.

    Example
    -------
    >>> w = ParamState(jnp.array([1.0, 2.0]), name='w')
    >>> @grad(grad_states={'w': w}, argnums=0, return_value=True)
    ... def loss(x):
    ...     return (w.value * x).sum() ** 2
    >>> (g, g_x), value = loss(jnp.ones(2))
    >>> g['w'].tolist(), g_x.tolist(), float(value)
    ([6.0, 6.0], [6.0, 12.0], 9.0)
    """
    if fun is None:
        return lambda f: grad(f, grad_states, argnums, holomorphic, allow_int, has_aux,
                              return_value, check_states=check_states)
    inner, (states, tree, nums) = _OpByOp(fun), _grad_targets(grad_states, argnums)
    uniq = list(dict.fromkeys(states))   # each State once

    def run(*args, **kwargs):
        n, touched = len(args), inner.get_states(*args, **kwargs)
        if any(not -n <= i < n for i in nums or ()):
            raise TypeError(f'grad(argnums={argnums!r}) of {_who(inner)}: the call passed '
                            f'{n} positional argument(s); pass the argument positionally '
                            'or fix argnums')
        _check_grad_states(inner, uniq, touched, check_states, allow_int)
        values = {s: s.value for s in touched}

        def loss(grad_values, *args, **kwargs):
            merged = {**values, **dict(zip(uniq, grad_values, strict=True))}
            new, out = inner.jaxpr_call([merged[s] for s in touched], *args, **kwargs)
            value, aux = _loss_of(inner, out, has_aux)
            return value, (value, aux, new)
        diff = jax.grad(loss, (0, *(i % n + 1 for i in nums or ())), has_aux=True,
                        holomorphic=holomorphic, allow_int=allow_int)
        g, (value, aux, new) = diff([s.value for s in uniq], *args, **kwargs)
        for state, written in zip(touched, new, strict=True):
            if written is not None:
                state.value = written
        state_grads = tree.unflatten([g[0][uniq.index(s)] for s in states])
        arg_grads = None if nums is None else g[1] if argnums is None or _is_int(argnums) else g[1:]
        grads = arg_grads if not uniq else state_grads if nums is None else (state_grads, arg_grads)
        extra = (value,) * bool(return_value) + (aux,) * bool(has_aux)
        return (grads, *extra) if extra else grads
    return _OpByOp(run, name=f'grad({inner.name})')


def _loss_of(inner, out, has_aux) -> tuple:
    """``(loss, aux)`` from what ``inner`` returned, refused unless a scalar (and a pair)."""
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f'grad(has_aux=True): {_who(inner)} must return a pair (loss, aux), not '
                        f'{jax.tree_util.tree_structure(out)}')
    value, aux = out if has_aux else (out, None)
    if not isinstance(value, (int, float, complex)) and getattr(value, 'shape', 0) != ():
        got = (f'shape {value.shape}' if hasattr(value, 'shape')
               else jax.tree_util.tree_structure(value))
        raise TypeError(f'grad: {_who(inner)} must return a scalar loss, not {got}; reduce it '
                        '(.sum(), .mean()) or differentiate it with jax.jacrev')
    return value, aux


class _OpByOp(StatefulFunction):
    """Called outside any trace, evaluates its jaxpr op by op, as ``jax.grad`` does: the value a
    gradient comes with is then the function's own, bit for bit (XLA may fuse it otherwise)."""
    _compiled_dispatch = False


def checkpoint(fun: Callable | None = None, *, prevent_cse: bool = True, policy=None,
               static_argnums=()) -> Callable:
    """``jax.checkpoint`` (``remat``) of a function that reads and writes States.

    Differentiated, ``fun`` is rematerialized: JAX saves its inputs, the values of the States it
    reads among them, and recomputes the rest, so a ``lax.scan`` body writing a hidden State
    trains through time with the memory of the explicit-carry program under ``jax.checkpoint``;
    a RandomState drawn inside advances once per call.  ``prevent_cse`` and ``policy`` are
    ``jax.checkpoint``'s; ``static_argnums`` as for StatefulFunction.  Outside any JAX trace it
    runs op by op, as ``jax.checkpoint`` does (JAX arrays out).  Without ``fun``, a decorator.

    Example
    -------
    >>> h = State(jnp.zeros(2), name='h')
    >>> @checkpoint
    ... def cell(w, x):
    ...     h.value = jnp.tanh(w * h.value + x)
    ...     return h.value.sum()
    >>> g = StatefulFunction(jax.grad(cell))(0.5, jnp.ones(2))   # as a scan body: JAX >= 0.7
    """
    if fun is None:
        return functools.partial(checkpoint, prevent_cse=prevent_cse, policy=policy,
                                 static_argnums=static_argnums)
    inner = _OpByOp(fun, static_argnums, name=f'checkpoint({_name_of(fun)})')
    rematerialized = functools.partial(jax.checkpoint, prevent_cse=prevent_cse, policy=policy)

    @functools.wraps(fun)
    def remat(*args, **kwargs):
        if not _under_jax_trace():
            return inner(*args, **kwargs)
        return inner._call_in_trace(args, kwargs, rematerialized)
    return remat


remat = checkpoint


# =============================================================================
# 9. StatefulMapping
#
# A trace at per-lane shapes finds the states ``fun`` touches, jax.vmap of it which writes
# vary across lanes; ``mapping_fn`` gets the state values explicitly, with per-state axes.
# =============================================================================

def _normalize_state_axes(spec, what: str) -> tuple:
    """``spec`` (``{axis: filter}``, or a filter for axis 0) as ``((axis, predicate), ...)``."""
    items = () if spec is None else spec.items() if isinstance(spec, dict) else [(0, spec)]
    for axis, _ in items:
        if not _is_int(axis):
            raise TypeError(f'{what} keys must be int axes, got {axis!r}; write '
                            f'{what}={{0: filter}} or {what}=filter')
    return tuple((int(axis), to_predicate(filt)) for axis, filt in items)


def _axis_for(state, axes: tuple, default=None):
    return next((axis for axis, predicate in axes if predicate((), state)), default)


def _lane_aval(axis: int, aval, error: Callable):
    """``(axis counted from the front, aval without it)``, or raises ``error()``."""
    shape = tuple(aval.shape)
    if not 0 <= (a := axis + len(shape) if axis < 0 else axis) < len(shape):
        raise error()
    return a, _mapped_aval(shape[a], a, aval)


def _lane_args(sf, leaves, split):
    """The flat arguments' avals in a lane, their axes, the batch sizes they imply, their avals."""
    static_args, dyn_args, _, dyn_kwargs = split
    static_pos = {i for i, _ in static_args}
    nargs, spec = len(dyn_args) + len(static_pos), sf.in_axes
    if not isinstance(spec, (tuple, list)):
        spec = [spec] * nargs
    elif len(spec) != nargs:
        raise ValueError(f'{_who(sf)}: in_axes has {len(spec)} entries for {nargs} positional '
                         'argument(s); give one axis (int or None) per argument, or one for all')
    axes = []   # one per flat leaf
    for i, (prefix, arg) in enumerate(zip([spec[i] for i in range(nargs) if i not in static_pos],
                                          dyn_args, strict=True)):
        try:
            jax.tree_util.tree_map(lambda p, sub: axes.extend([p] * len(_leaves(sub))),
                                   prefix, arg, is_leaf=lambda x: x is None)
        except ValueError as err:
            raise ValueError(f'{_who(sf)}: in_axes entry {prefix!r} '
                             f'does not match argument {i}: {err}') from None
    axes += [0] * len(_leaves(dyn_kwargs))
    paths = [('keyword ' if p[0].idx else '') + jax.tree_util.keystr(p[1:])
             for p, _ in jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0]]
    avals = [_aval_of(x) for x in leaves]
    lane_avals, arg_axes, sizes = list(avals), [None] * len(avals), []
    for j, (path, aval, ax) in enumerate(zip(paths, avals, axes, strict=True)):
        if ax is None:
            continue
        if not _is_int(ax):
            raise ValueError(f'{_who(sf)}: in_axes entries must be int or None, got {ax!r}')
        arg_axes[j], lane_avals[j] = _lane_aval(ax, aval, lambda: ValueError(
            f'{_who(sf)}: in_axes={ax} is out of range for argument leaf {path} of '
            f'shape {tuple(aval.shape)}'))
        sizes.append((f'argument {path} (axis {ax})', aval.shape[arg_axes[j]]))
    return lane_avals, arg_axes, sizes, avals


def _check_sizes(sf, sizes) -> None:
    if len({s for _, s in sizes}) > 1:
        listing = '\n'.join(f'  - {where}: {size}' for where, size in sizes)
        raise BatchAxisError(f'{_who(sf)}: Inconsistent batch sizes:\n{listing}\nall mapped '
                             'arguments and batched states must share one batch size')


class StatefulMapping(StatefulFunction):
    """Maps a stateful function over a batch, like ``jax.vmap`` for States.

    States matched by ``state_in_axes`` (``{axis: filter}``, or a bare filter for axis 0)
    are split along that axis on the way in and stacked along it (or as ``state_out_axes``
    says) on the way out; other states are broadcast.  Every touched :class:`RandomState`
    gets one key per lane (as ``split_key(n)`` would), then holds the advanced key.  An
    unbatched state written with a batched value leaves batched on axis 0: silently
    (``unexpected_out_state_mapping='auto'``, ``'ignore'``), with a warning (``'warn'``),
    or not at all (``'raise'``: :class:`BatchAxisError`).

    ``in_axes`` / ``out_axes`` are ``jax.vmap``'s (keyword arguments map over axis 0); ``axis_size``
    is the batch size where nothing is batched; ``axis_name`` names the axis for collectives;
    ``mapping_fn`` is ``jax.vmap``, ``jax.pmap`` or a shard_map-based mapper like them.  The rest is
    :class:`StatefulFunction`'s; its accessors describe the whole mapped call, its States in the
    order the function first touched them (as brainstate's).

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

    _traced_eagerly = True

    def __init__(self, fun: Callable, in_axes=0, out_axes=0, state_in_axes=None,
                 state_out_axes=None, static_argnums=(), static_argnames=(), axis_env=None,
                 abstracted_axes=None, axis_size: int | None = None, axis_name=None,
                 name: str | None = None, mapping_fn: Callable = jax.vmap,
                 unexpected_out_state_mapping: str = 'auto', *, donate_states=None,
                 keep_sharding=True, explain_cache_misses: bool | None = None):
        if abstracted_axes is not None:
            raise NotImplementedError('StatefulMapping does not support abstracted_axes; '
                                      'map over concrete shapes instead')
        super().__init__(fun, static_argnums, static_argnames, axis_env, None, name, False,
                         donate_states=donate_states, keep_sharding=keep_sharding,
                         explain_cache_misses=explain_cache_misses)
        self.origin_fun = fun
        if unexpected_out_state_mapping not in (policies := ('auto', 'warn', 'raise', 'ignore')):
            raise ValueError(f'unexpected_out_state_mapping must be one of {policies}, got '
                             f'{unexpected_out_state_mapping!r}')
        if axis_size is not None and (not _is_int(axis_size) or not 0 < axis_size < 2**31):
            raise ValueError(f'axis_size must be a positive int below 2**31, got {axis_size!r}')
        if not callable(mapping_fn):
            raise TypeError(f'mapping_fn must be callable like jax.vmap, got {mapping_fn!r}')
        self.in_axes, self.out_axes = in_axes, out_axes
        self.state_in_axes, self.state_out_axes = state_in_axes, state_out_axes
        self._state_in = _normalize_state_axes(state_in_axes, 'state_in_axes')
        self._state_out = _normalize_state_axes(state_out_axes, 'state_out_axes')
        self.unexpected_out_state_mapping = unexpected_out_state_mapping
        self.axis_size, self.axis_name, self.mapping_fn = axis_size, axis_name, mapping_fn
        self._compiled_dispatch = mapping_fn is not jax.pmap   # pmap compiles; jit-of-pmap warns

    def _build_entry(self, key, leaves, split) -> _Entry:
        """Traces one lane, settles each state's axes and maps the lane with ``mapping_fn``."""
        lane_avals, arg_axes, sizes, avals = _lane_args(self, leaves, split)
        if self.axis_size is not None:
            sizes.append(('axis_size', self.axis_size))
        _check_sizes(self, sizes)
        guess, found = not sizes and self.axis_name is not None, list(sizes)
        try:
            traced, state_axes, found = self._discover(lane_avals, split, found,
                                                       sizes[0][1] if sizes else 1)
        except Exception:   # (maybe code shaped by the guessed axis size: see below)
            if not (guess and found and found[0][1] != 1):
                raise
        if guess and found and found[0][1] != 1:
            # Collectives saw a guessed axis size: trace again with a batched State's.
            traced, state_axes, found = self._discover(lane_avals, split, [], found[0][1])
        if not found:
            raise ValueError(f'{_who(self)}: nothing is batched (no in_axes entry, no state in '
                             'state_in_axes), so the batch size is unknown; pass axis_size=n')
        n, states, run = found[0][1], traced.states, traced.runner(self.name)
        rng_index = [i for i, s in enumerate(states) if isinstance(s, RandomState)]
        in_batched = [a is not None for a in arg_axes] + [   # per jaxpr input
            state_axes[i] is not None for i, sig in enumerate(traced.state_sigs) for _ in sig[1]]
        out_axes = self._out_axes(traced, state_axes, rng_index, in_batched, n)
        write_axes = {r: out_axes[i] for r, i in enumerate(traced.returned) if i in out_axes}

        def lane(how, lane_args, lane_states):   # (whole: a mapping is rarely nested)
            out, returned = run(lane_states, lane_args, how)
            return out, [returned[r] for r in write_axes]

        mapped = {how: self.mapping_fn(functools.partial(lane, how), in_axes=(
            list(arg_axes), state_axes), out_axes=(self.out_axes, list(write_axes.values())),
            axis_name=self.axis_name, axis_size=None if any(in_batched) else n)
            for how in ('whole', 'eager')}

        def apply(state_values, flat_args, how=''):   # each RandomState: one key per lane, one kept
            keys = {i: jax.random.split(state_values[i], n + 1) for i in rng_index}
            layout = keys and _lane_key_layout([*zip(flat_args, arg_axes), *(
                (x, state_axes[i]) for i, v in enumerate(state_values) for x in _leaves(v))])
            values = [(_reshard(keys[i][1:], layout) if layout else keys[i][1:]) if i in keys
                      else v for i, v in enumerate(state_values)]
            # (then by equation: a key's lane type may lack the mesh its lanes now have)
            out, written = mapped['eager' if layout else how or 'whole'](list(flat_args), values)
            return out, list(written) + [k[0] for k in keys.values()]

        def whole(*args, **kwargs):   # the accessors' view: the mapped call as one function
            for state in states:     # the first touch fixes the jaxpr input order, as in the lanes
                state.value
            return self(*args, **kwargs)
        rebuild = _rebuilder(split)   # not ``split``, which holds the call's arrays
        return _Entry(traced, self._plan_for(states, (*out_axes, *rng_index)), apply,
                      lambda: _trace_stateful(whole, avals, rebuild, name=self.name,
                                              return_only_write=False, axis_env=self.axis_env))

    def _out_axes(self, traced, state_axes, rng_index, in_batched, n: int) -> dict:
        """The axis each written state but a RandomState leaves along, by state index: as
        ``state_out_axes`` says, else as it came in, else 0 if written varying across lanes."""
        out_axes = {i: _axis_for(traced.states[i], self._state_out, state_axes[i])
                    for i in traced.returned if i not in rng_index}
        closed, first = traced.closed_jaxpr, traced.n_out
        at = traced.state_tree.unflatten(range(first, first + traced.state_tree.num_leaves))
        picked = [(i, j) for r, i in enumerate(traced.returned) if out_axes.get(i, 0) is None
                  for j in _leaves(at[r])]   # (state index, jaxpr output) of unbatched ones
        if not picked:
            return out_axes
        avals = [ShapedArray((n, *a.shape) if b else a.shape, a.dtype, weak_type=a.weak_type)
                 for a, b in zip(closed.in_avals, in_batched, strict=True)]
        run = _jaxpr_as_fun(closed)
        with _axis_env(self.axis_env):   # (no flags at all when no output is batched)
            flags = _batched_flags(lambda *xs: [run(*xs)[j] for _, j in picked], avals,
                                   [0 if b else None for b in in_batched], self.axis_name, n)
        for i in dict.fromkeys(i for (i, _), batched in zip(picked, flags) if batched):
            message = (f'{_who(self)}: {traced.states[i]._describe()} came in unbatched but is '
                       'written with a batched value, so it leaves batched along axis 0. Declare '
                       'it with state_in_axes (batched in) or state_out_axes (batched out)')
            if self.unexpected_out_state_mapping == 'raise':
                raise BatchAxisError(message + ", or set unexpected_out_state_mapping='auto'")
            if self.unexpected_out_state_mapping == 'warn':
                warnings.warn(message, UserWarning, stacklevel=_outside(skip_jax=True)[1])
            out_axes[i] = 0
        return out_axes

    def _discover(self, lane_avals, split, sizes, size):
        """Traces one lane: its trace, each state's axis (0 for a RandomState), all sizes seen
        (appended to ``sizes`` as seen)."""
        state_axes = {}

        def lift_aval(state, aval):
            """A leaf of ``state`` as one lane sees it; the state's first leaf fixes its axis."""
            if (axis := state_axes.get(id(state), _MISSING)) is _MISSING:
                if isinstance(state, RandomState) and aval.ndim > (0 if _is_typed_key(aval) else 1):
                    raise BatchAxisError(f'{state._describe()} holds {aval.str_short()}, a '
                                         'stack of keys; a mapping splits every RandomState '
                                         'per lane itself: give it a single key instead')
                axis = 0 if isinstance(state, RandomState) else _axis_for(state, self._state_in)
                state_axes[id(state)] = axis
            if axis is None or isinstance(state, RandomState):   # keys are split per lane later
                return aval
            a, lane = _lane_aval(axis, aval, lambda: BatchAxisError(
                f'state_in_axes maps {state._describe()} along axis {axis}, but its value '
                f'has shape {tuple(aval.shape)}; fix state_in_axes or the state\'s shape'))
            sizes.append((f'{state._describe()} (axis {axis})', aval.shape[a]))
            _check_sizes(self, sizes)
            return lane

        axis_env = list(self.axis_env or ()) + (
            [] if self.axis_name is None else [(self.axis_name, size)])
        try:
            traced = _trace_stateful(self.fun, lane_avals, _rebuilder(split), name=self.name,
                                     return_only_write=True, axis_env=axis_env,
                                     lift_aval=lift_aval, lessons=self._lessons)
        except NameError as err:
            if not _unbound_axis(err) or self.axis_name is not None:
                raise
            raise NameError(f'{err}\n{_who(self)} maps its axis without a name; to use it in '
                            "collectives (lax.psum ...), pass axis_name='<name>'") from err
        # Axes stay as declared (negative too): the mapper resolves them per leaf.
        return traced, [state_axes.get(id(s)) for s in traced.states], sizes


# =============================================================================
# 10. Shipping
#
# An export whose states are named inputs and outputs: jax.export checks shapes, platforms,
# devices; the container adds the states' manifest and a checksum refusing damaged bytes first.
# =============================================================================

_EXPORT_MAGIC = b'stateful_jaxpr.export 2\n'   # the number is the container's format


def _key_data(tree, impls=()):
    """Typed keys as key data (jax.export up to 0.5 takes no keys); with ``impls``, the reverse."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [jax.random.key_data(x) if _is_typed_key(x) else x for x in leaves]
    for i, impl in impls:
        leaves[i] = jax.random.wrap_key_data(leaves[i], impl=impl)
    return treedef.unflatten(leaves)


def _key_impls(tree) -> list:
    return [[i, _key_impl_name(x)] for i, x in enumerate(_leaves(tree)) if _is_typed_key(x)]


def _named(err, name: str):   # an error of jax.export, led by ``name``
    kind = next(k for k in (TypeError, NotImplementedError, ValueError) if isinstance(err, k))
    return kind(f'{name}: {err}')


def _pytree_slots(exported) -> list:
    """``(label, node types)`` per argument, State and result of a jax.export Exported."""
    def types(tree):
        data = tree.node_data()
        return {data and data[0]}.union(*map(types, tree.children()))

    def keyed(tree):   # a dict node's (key, child) pairs
        return zip(tree.node_data()[1], tree.children(), strict=True)
    (args, kwargs), (out, new) = exported.in_tree.children(), exported.out_tree.children()
    slots = [(f'argument {i}', t) for i, t in enumerate(args.children())]
    slots += [(f'keyword argument {k!r}', t) for k, t in keyed(kwargs) if k != 'states']
    slots += [(f'state {n!r}', t) for k, s in keyed(kwargs) if k == 'states' for n, t in keyed(s)]
    slots += [('the result', out)] + [(f'state {n!r}', t) for n, t in keyed(new)]
    return [(label, types(t)) for label, t in slots]


def _unregistered(err, where: str, slots):
    """jax.export's refusal ``err`` of an unregistered pytree type, naming its slots; else None."""
    found = _unregistered_type(err)
    held = found and ', '.join(dict.fromkeys(k for k, ts in slots if found[1] in map(str, ts)))
    return found and ValueError(
        f'{where}: {held or "a value"} holds a pytree of type {found[1]}, which jax.export '
        'serializes only once registered, under one serialized_name in the exporting and the '
        'loading process: jax.export.register_namedtuple_serialization for a NamedTuple, else '
        'jax.export.register_pytree_node_serialization')


class Exported:
    """What :func:`export` returns and :func:`deserialize` loads: ``exported`` is jax.export's,
    ``manifest`` JSON naming the ``function``, ``static_arguments`` and per State its ``name``,
    ``type``, ``role`` and ``created_at``.

    Example
    -------
    >>> export(lambda x: x * 2, 1.0)(3.0)[0].item()
    6.0
    """

    def __init__(self, exported, manifest: dict):
        self.exported, self.manifest = exported, manifest

    def serialize(self, vjp_order: int = 0) -> bytes:
        """Bytes for :func:`deserialize`, also storing ``vjp_order`` orders of derivatives."""
        if not _is_int(vjp_order) or vjp_order < 0:
            raise (ValueError if _is_int(vjp_order) else TypeError)(
                f'Exported.serialize(vjp_order=...) needs an int >= 0, got {vjp_order!r}')
        slots = _pytree_slots(self.exported)
        try:
            data = bytes(self.exported.serialize(vjp_order=vjp_order))
        except ValueError as err:
            where = f"Exported.serialize of {self.manifest['function']!r}"
            if better := _unregistered(err, where, slots):
                raise better from err
            raise
        names, registry = {}, _probe(_EXPORT_REGISTRY) or {}   # a loading process lacking a
        for label, types in slots:                              # type hears which slot holds it
            names.setdefault(label, set()).update(registry[t][0] for t in types if t in registry)
        header = json.dumps({**self.manifest, 'pytrees': {k: sorted(v) for k, v in names.items()
                                                          if v}}, sort_keys=True).encode()
        body = len(header).to_bytes(8, 'little') + header + data
        return _EXPORT_MAGIC + hashlib.sha256(body).digest() + body

    def __call__(self, *args, states=None, **kwargs):
        """Runs on the checked arguments and ``states``: ``(outputs, {written state: value})``."""
        name = f"exported {self.manifest['function']!r}"
        roles = {s['name']: s['role'] for s in self.manifest['states']}
        if not isinstance(states, (dict, type(None))):
            raise TypeError(f'{name}: states= must be a dict {{state name: value}}, got '
                            f'{type(states).__name__}')
        states, needed = states or {}, [n for n, role in roles.items() if role != 'written']
        for what, tree in (('argument ', args), ('keyword argument ', kwargs), ('states=', states)):
            _reject_states(tree, f'{name}: {what}', lambda err, path, leaf: type(err)(
                f'{name}: {what}{path} is {leaf!r} (a {type(leaf).__name__}), which JAX cannot '
                f'take ({err}); pass an array'))
        if problems := [f'{what} {names}' for what, names in (
                ('lacks', [n for n in needed if n not in states]),
                ('has names it does not know:', [n for n in states if n not in roles])) if names]:
            listing = ', '.join(f'{n!r} ({role})' for n, role in roles.items()) or 'none'
            raise ValueError(f'{name}: states= {" and ".join(problems)}; its states are: '
                             f'{listing}.  Pass states={{name: value}} for every state it reads')
        try:
            result = self.exported.call(*_key_data(args), **_key_data(kwargs),
                                        states=_key_data({n: states[n] for n in needed}))
        except (TypeError, ValueError, NotImplementedError) as err:
            if fixed := ', '.join(map(' = '.join, self.manifest['static_arguments'].items())):
                err = type(err)(f'{str(err).rstrip()} (the static arguments, fixed at export and '
                                f'not passed: {fixed})')
            raise _named(err, name) from err
        return _key_data(result, self.manifest['result_keys'])

    def __repr__(self):
        roles = ', '.join(f"{s['name']!r} {s['role']}" for s in self.manifest['states'])
        return (f"Exported({self.manifest['function']!r}, platforms="
                f"{tuple(self.exported.platforms)}, states: {roles or 'none'})")


def export(fun, *args, platforms: str | Sequence[str] | None = None, **kwargs) -> Exported:
    """Exports ``fun(*args, **kwargs)`` (a StatefulFunction, StatefulMapping or plain function)
    with ``jax.export``, its uniquely named States becoming named inputs and outputs; no State
    changes.  The arguments fix the shapes (static ones the values); ``platforms``: a name or names
    (default: the current backend).  ``ex(*args, states={name: value of each state read})`` gives
    ``(outputs, {written state: new value})``.  Needs ``flatbuffers`` (+ ``absl-py`` on JAX 0.4).

    Example
    -------
    >>> acc = State(jnp.zeros(3), name='acc')
    >>> def add(x):
    ...     acc.value = acc.value + x
    ...     return acc.value.sum()
    >>> ex = export(add, jnp.ones(3), platforms='cpu')
    >>> out, new = ex(jnp.ones(3), states={'acc': jnp.ones(3)})
    >>> float(out), new['acc'].tolist()
    (6.0, [2.0, 2.0, 2.0])
    """
    platforms = (platforms,) if isinstance(platforms, str) else platforms
    if not (platforms is None or isinstance(platforms, Sequence)
            and all(isinstance(p, str) for p in platforms)):
        raise TypeError("export: platforms= takes a platform name or a sequence of names "
                        f"(e.g. 'cpu' or ['cpu', 'cuda']), got {platforms!r}")
    if 'states' in kwargs:
        raise ValueError("export: rename the keyword argument 'states', which clashes with states=")
    sf = fun if isinstance(fun, StatefulFunction) else StatefulFunction(fun)
    key, leaves, split = sf._cache_key(args, kwargs)
    traced = sf._entry_for(key, leaves, split, count=True).described()
    names, roles = [s._name for s in traced.states], _state_roles(traced)
    if bad := ''.join(f'  - {s._describe()}{"" if s._name else " (no name)"}\n'
                      for s in traced.states if not s._name or names.count(s._name) > 1):
        raise ValueError(f'export: an export passes States by name, but these of {_who(sf)} '
                         f"have no name or share one:\n{bad}Give each a unique name "
                         "(State(..., name='w') or state.name = 'w')")
    static_args, dyn_args, static_kwargs, dyn_kwargs = split
    rebuild, read = _rebuilder(split), [role != 'written' for role in roles]
    inputs = {n: s._value for n, s, r in zip(names, traced.states, read, strict=True) if r}
    in_keys, out_keys = _key_impls((dyn_args, dyn_kwargs, inputs)), []

    def pure(*dyn_args, states, **dyn_kwargs):
        dyn_args, dyn_kwargs, states = _key_data((dyn_args, dyn_kwargs, states), in_keys)
        values = [states[n] if r else sig[0].unflatten([jnp.zeros(sh, dt) for sh, dt, *_ in sig[1]])
                  for n, r, sig in zip(names, read, traced.state_sigs, strict=True)]
        full_args, full_kwargs = rebuild(_leaves((dyn_args, dyn_kwargs)))
        new, out = sf.jaxpr_call(values, *full_args, **full_kwargs)
        result = out, {n: v for n, v, role in zip(names, new, roles, strict=True) if role != 'read'}
        out_keys[:] = _key_impls(result)
        return _key_data(result)
    pure.__name__ = pure.__qualname__ = sf.name   # how jax.export's own errors name it
    try:
        exported = _jax_export().export(jax.jit(pure), platforms=platforms)(
            *_key_data(dyn_args), **_key_data(dyn_kwargs), states=_key_data(inputs))
    except (TypeError, ValueError, NotImplementedError) as err:
        raise _named(err, f'export of {_who(sf)}') from err
    return Exported(exported, {
        'function': sf.name, 'jax_version': jax.__version__, 'result_keys': out_keys,
        'static_arguments': {**{f'argument {i}': repr(v) for i, v in static_args},
                             **{f'keyword {k!r}': repr(v) for k, v in static_kwargs.items()}},
        'states': [{'name': n, 'type': type(s).__name__, 'role': r, 'created_at': s.source_info}
                   for n, s, r in zip(names, traced.states, roles, strict=True)]})


def deserialize(data) -> Exported:
    """Loads :meth:`Exported.serialize`'s bytes (no user code needed); damaged, cut short or
    foreign bytes are a ValueError.

    Example
    -------
    >>> n = State(jnp.zeros(()), name='n')
    >>> loaded = deserialize(export(lambda x: x * n.value, 2.0).serialize())
    >>> float(loaded(2.0, states={'n': jnp.float32(4.0)})[0])
    8.0
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError('deserialize takes the bytes Exported.serialize() returned, got '
                        f'{type(data).__name__}')
    data, start = bytes(data), len(_EXPORT_MAGIC) + 32
    if not data.startswith(_EXPORT_MAGIC):
        raise ValueError("deserialize: these bytes were not made by stateful_jaxpr's "
                         'Exported.serialize() of this release, or were cut short (bytes '
                         'from jax.export load with jax.export.deserialize)')
    if hashlib.sha256(data[start:]).digest() != data[len(_EXPORT_MAGIC):start]:
        raise ValueError('deserialize: these bytes are damaged or cut short (their checksum '
                         'does not match); export and serialize the function again')
    module, where, pytrees = _jax_export(), 'deserialize', {}
    try:   # only bytes with a valid checksum that this module did not write get here
        end = start + 8 + int.from_bytes(data[start:start + 8], 'little')
        manifest = json.loads(data[start + 8:end])
        manifest['result_keys'], [s['role'] for s in manifest['states']]
        pytrees = dict(manifest.pop('pytrees', {}))   # see Exported.serialize
        where = f"deserialize of {manifest['function']!r}"
        return Exported(module.deserialize(bytearray(data[end:])), manifest)
    except Exception as err:
        raise _unregistered(err, where, pytrees.items()) or ValueError(
            f'deserialize: these bytes are not an export of stateful_jaxpr '
            f'({type(err).__name__}: {err})') from err


# =============================================================================
# 11. Jaxpr passes: constant folding
# =============================================================================

class IdentitySet(collections.abc.MutableSet):
    """A mutable set of objects compared by identity (for unhashable values such as arrays).

    Example
    -------
    >>> a = np.zeros(2)
    >>> s = IdentitySet([a, a])
    >>> len(s), a in s, np.zeros(2) in s
    (1, True, False)
    """

    def __init__(self, iterable: Iterable | None = None):
        self._data: dict = {id(value): value for value in iterable or ()}

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


# Folded values bigger than this (elements) and than their inputs only materialise constants.
_FOLD_MAX_GROWTH = 1024


def _size(atoms) -> int:
    return sum(int(math.prod(getattr(a.aval, 'shape', ()))) for a in atoms)


def _fold(jaxpr, consts, in_values=()):
    """``(folded jaxpr, each output's known value or _MISSING)``, known values inlined as literals
    (scalars; all in a bare Jaxpr: ``consts`` None) or consts; ``in_values``: a call body's."""
    known = dict(zip(jaxpr.invars, in_values))     # Var -> value known at fold time
    const_values = dict(zip(jaxpr.constvars, consts or ()))   # new consts join at the end
    invars = set(jaxpr.invars)

    def value_of(atom):
        return (atom.val if isinstance(atom, Literal)
                else known.get(atom, const_values.get(atom, _MISSING)))

    def substitute(atom):
        if isinstance(atom, Literal) or atom not in known or atom in invars:
            return atom
        if consts is None or np.shape(known[atom]) == ():   # a weak type stays: a Python scalar
            value = np.asarray(known[atom])                  # or (rare) the array itself
            if getattr(atom.aval, 'weak_type', False):
                value = value.item() if value.shape == () else known[atom]
            return _literal(value, atom.aval)
        const_values[atom] = known[atom]
        return atom

    eqns = []
    for eqn in jaxpr.eqns:
        eqn, outs = _evaluate(eqn, [value_of(v) for v in eqn.invars])
        if outs is None:   # what is known of its inputs is final by now
            eqns.append(eqn.replace(invars=[substitute(v) for v in eqn.invars]))
        else:
            known.update(zip(eqn.outvars, outs, strict=True))
    outvars = [substitute(v) for v in jaxpr.outvars]
    used = {v for v in [*outvars, *(v for e in eqns for v in e.invars)] if isinstance(v, Var)}
    constvars = [v for v in (jaxpr.constvars if consts is None else const_values) if v in used]
    folded = _rebuild(jaxpr, None if consts is None else [const_values[v] for v in constvars],
                      constvars=constvars, eqns=eqns, outvars=outvars)
    return folded, [value_of(v) for v in jaxpr.outvars]


def _evaluate(eqn, values):
    """``(eqn, its outputs if it folds with these values, else None)``; a call folds if all its
    body (folded with them) does.  Typed keys never fold: no literal or numpy const holds one."""
    param, body = _call_body(eqn)
    if param is not None:
        body, outs = _fold(getattr(body, 'jaxpr', body), getattr(body, 'consts', None), values)
        eqn = eqn.replace(params={**eqn.params, param: body})
    if (not _folds(eqn) or any(v is _MISSING or isinstance(v, Tracer) for v in values)
            or any(_is_typed_key(v.aval) for v in eqn.outvars)):
        return eqn, None
    if param is not None:
        return eqn, None if any(v is _MISSING for v in outs) else outs
    if (not eqn.invars or _nested_jaxprs(eqn.params)
            or _size(eqn.outvars) > max(_size(eqn.invars), _FOLD_MAX_GROWTH)):
        return eqn, None
    try:
        return eqn, _bind(eqn, values)
    except Exception:  # e.g. a primitive with no eager rule: keep it
        return eqn, None


def constant_fold_jaxpr(jaxpr):
    """Evaluates every equation whose inputs are all known and inlines the results.

    Takes a ``Jaxpr`` or ``ClosedJaxpr``; returns the same kind with the same interface (invars,
    outvar avals, debug info), so the same numbers (a ``Jaxpr`` carrying its consts, JAX 0.11
    and newer, may come back carrying more: evaluate it with its own ``consts``).  Never folded:
    equations without inputs, random-number, control-flow, callback and other effectful
    primitives, and ones that would only materialise a large constant.  Nested ``pjit`` /
    ``closed_call`` bodies are folded too.

    Example
    -------
    >>> table = jnp.array([0.0, 1.0, 2.0])
    >>> cj = jax.make_jaxpr(lambda x: x + jnp.exp(table) * 2)(jnp.ones(3))
    >>> len(constant_fold_jaxpr(cj).eqns) < len(cj.eqns)
    True
    """
    if not isinstance(jaxpr, (ClosedJaxpr, Jaxpr)):
        raise TypeError(f'constant_fold_jaxpr needs a Jaxpr or ClosedJaxpr, got '
                        f'{type(jaxpr).__name__}')
    return _fold(getattr(jaxpr, 'jaxpr', jaxpr), getattr(jaxpr, 'consts', None))[0]


# =============================================================================
# 12. Demo: ``python stateful_jaxpr.py``
# =============================================================================

def main() -> None:
    """A short tour: a labelled jaxpr, a compiled stateful step, a mapping with per-lane keys."""
    print(f'stateful_jaxpr on jax {jax.__version__}\n')
    weight = ParamState(jnp.array([0.5, -1.0, 2.0]), name='weight')
    trace = LongTermState(jnp.zeros(3), name='trace')
    count = State(jnp.array(0), name='count')

    def step(x):
        trace.value = 0.9 * trace.value + x      # a running statistic
        count.value = count.value + 1
        return jnp.dot(weight.value, trace.value)

    sf, x = StatefulFunction(step), jnp.ones(3)
    print('1. step(x) traced to a jaxpr; the states it touches become inputs, the ones it\n'
          f'   writes become outputs (sf.pretty_jaxpr(x)):\n\n{sf.pretty_jaxpr(x)}')
    print('\n2. calling it runs a compiled executable and updates the states:')
    for i in range(3):   # the call runs before the states are printed
        print(f'   call {i}: out={float(sf(x)):+.4f} trace={trace.value} count={int(count.value)}')
    print('\n3. cache statistics:', sf.get_cache_stats()['jaxpr_cache'])

    rng, h = RandomState(0, name='rng'), HiddenState(jnp.zeros((4, 3)), name='h')

    def noisy(inp):
        h.value = h.value + inp + 0.1 * jax.random.normal(rng.split_key(), (3,))
        return h.value.mean()

    out = StatefulMapping(noisy, in_axes=0, state_in_axes={0: HiddenState})(jnp.ones((4, 3)))
    print(f'\n4. StatefulMapping over 4 lanes, one random key per lane:\n'
          f'   out={np.round(np.asarray(out), 3)}\n   h=\n{np.round(np.asarray(h.value), 3)}')


_LIBRARY_END = main.__code__.co_firstlineno   # the demo is user code: its States show its lines

if __name__ == '__main__':
    main()
