# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""Tests for stateful_jaxpr: ``python -W error::DeprecationWarning -m unittest -v test_stateful_jaxpr``.

Standard library + jax only.  Eight host CPU devices are requested before JAX
is imported so that the pmap / shard_map tests run anywhere.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import gc
import re
import subprocess
import sys
import threading
import unittest
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import stateful_jaxpr as sj
from stateful_jaxpr import (State, RandomState, StatefulFunction, StateTraceStack,
                            TraceContextError)

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------

def _tracer_in(state) -> bool:
    """Whether a JAX tracer is reachable from ``state`` (its stored value)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(state._value))


def _snapshot(states):
    return [jax.tree_util.tree_map(np.asarray, s._value) for s in states]


def _assert_same(test, states, snapshot):
    for s, old in zip(states, snapshot):
        test.assertFalse(_tracer_in(s), f'{s!r} holds a tracer')
        new = jax.tree_util.tree_map(np.asarray, s._value)
        test.assertEqual(jax.tree_util.tree_structure(new), jax.tree_util.tree_structure(old))
        for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old)):
            np.testing.assert_array_equal(a, b)


class _Boom(Exception):
    pass


# ---------------------------------------------------------------------------
# States
# ---------------------------------------------------------------------------

class StateTest(unittest.TestCase):

    def test_value_is_plain_attribute_outside_trace(self):
        s = State(jnp.ones(3))
        s.value = s.value * 2
        np.testing.assert_array_equal(s.value, 2 * np.ones(3))

    def test_assigning_a_state_is_value_error(self):
        a, b = State(1.0, name='a'), State(2.0, name='b')
        with self.assertRaisesRegex(ValueError, "State 'a'.*value"):
            a.value = b
        with self.assertRaises(ValueError):
            a.value = {'x': b}
        self.assertEqual(a.value, 1.0)

    def test_check_state_value_tree(self):
        s = State({'a': jnp.ones(2)}, name='tree')
        s.value = {'b': 1.0}          # outside the context manager anything goes
        with sj.check_state_value_tree():
            s.value = {'b': 2.0}
            with self.assertRaisesRegex(ValueError, "'tree'.*structure"):
                s.value = {'c': 2.0}
        self.assertEqual(s.value, {'b': 2.0})

    def test_restore_value_records_read_not_write(self):
        s = State(1.0)
        with StateTraceStack() as st:
            s.restore_value(5.0)
        self.assertEqual(st.been_writen, [False])
        self.assertEqual(s.value, 5.0)

    def test_metadata_and_source_info(self):
        s = State(jnp.zeros(2), name='w', tag='param', unit='mV')
        self.assertEqual(s.name, 'w')
        self.assertEqual(s.tag, 'param')
        self.assertEqual(s.metadata['unit'], 'mV')
        self.assertEqual(s.stack_level, 0)
        self.assertIn('test_stateful_jaxpr.py', s.source_info)
        with self.assertRaisesRegex(ValueError, r"bad.*'w'.*test_stateful_jaxpr\.py"):
            s.raise_error_with_source_info(ValueError('bad'))

    def test_stack_level_counts_active_traces(self):
        levels = []

        def f(x):
            levels.append(State(0.0).stack_level)
            return x
        StatefulFunction(f)(1.0)
        self.assertEqual(levels, [1])

    def test_copy_replace_numel_repr(self):
        s = sj.ParamState({'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}, name='layer', tag='t')
        c = s.copy()
        self.assertIsInstance(c, sj.ParamState)
        self.assertIsNot(c, s)
        self.assertEqual(c.name, 'layer')
        self.assertEqual(c.tag, 't')
        r = s.replace(jnp.ones(4))
        self.assertEqual(r.value.shape, (4,))
        self.assertEqual(s.numel(), 9)
        text = repr(s)
        self.assertIn('ParamState', text)
        self.assertIn("'w'", text)
        self.assertIn('layer', text)

    def test_identity_semantics(self):
        a, b = State(1.0), State(1.0)
        self.assertEqual(hash(a), hash(id(a)))
        self.assertNotEqual(a, b)
        self.assertEqual(a, a)
        self.assertEqual(len({a, b}), 2)

    def test_marker_subclasses(self):
        for cls in (sj.ShortTermState, sj.LongTermState, sj.ParamState, sj.BatchState,
                    sj.HiddenState):
            self.assertTrue(issubclass(cls, State))
        sj.HiddenState(jnp.zeros(3))
        with self.assertRaisesRegex(ValueError, 'HiddenState'):
            sj.HiddenState({'a': jnp.zeros(3)})

    def test_catch_new_states(self):
        with sj.catch_new_states('new') as caught:
            a = State(1.0)
            b = RandomState(0)
        outside = State(2.0)
        self.assertEqual(caught.get_states(), [a, b])
        self.assertEqual(a.tag, 'new')
        self.assertNotIn(outside, caught.get_states())
        self.assertEqual(caught.get_state_values()[0], 1.0)

    def test_tracer_write_outside_stateful_trace_raises(self):
        s = State(jnp.zeros(3), name='leaky')

        @jax.jit
        def f(x):
            s.value = x
            return x
        with self.assertRaisesRegex(TraceContextError, "'leaky'.*StatefulFunction"):
            f(jnp.ones(3))
        np.testing.assert_array_equal(s.value, np.zeros(3))
        self.assertFalse(_tracer_in(s))

    def test_state_created_inside_the_same_jit_may_hold_tracers(self):
        @jax.jit
        def f(x):
            local = State(x)
            local.value = local.value * 3
            return local.value
        self.assertEqual(float(f(2.0)), 6.0)


class RandomStateTest(unittest.TestCase):

    def test_int_seed_is_prngkey(self):
        r = RandomState(42)
        np.testing.assert_array_equal(r.value, jax.random.PRNGKey(42))
        self.assertEqual(r.value.dtype, jnp.uint32)
        self.assertEqual(r.value.shape, (2,))

    def test_none_seed_gives_fresh_raw_key(self):
        a, b = RandomState(), RandomState()
        self.assertEqual(a.value.shape, (2,))
        self.assertFalse(np.array_equal(a.value, b.value))

    def test_typed_and_raw_keys_accepted(self):
        typed = jax.random.key(3)
        r = RandomState(typed)
        self.assertIs(r.value, typed)
        k = r.split_key()
        self.assertTrue(jnp.issubdtype(k.dtype, jax.dtypes.prng_key))
        raw = jax.random.PRNGKey(3)
        self.assertIs(RandomState(raw).value, raw)

    def test_seed_resets(self):
        r = RandomState(0)
        r.seed(7)
        np.testing.assert_array_equal(r.value, jax.random.PRNGKey(7))
        key = jax.random.PRNGKey(9)
        r.seed(key)
        np.testing.assert_array_equal(r.value, key)
        before = np.asarray(r.value)
        r.seed()
        self.assertFalse(np.array_equal(before, r.value))

    def test_malformed_seed_or_key(self):
        for bad in ('x', 1.5, jnp.zeros(3), jnp.zeros(2, jnp.float32), True):
            with self.assertRaises(ValueError, msg=repr(bad)):
                RandomState(bad)
        r = RandomState(0)
        with self.assertRaises(ValueError):
            r.seed('nope')

    def test_split_key(self):
        r = RandomState(0)
        k0 = np.asarray(r.value)
        k = r.split_key()
        self.assertEqual(k.shape, (2,))
        self.assertFalse(np.array_equal(k0, r.value))
        keys = r.split_key(5)
        self.assertEqual(keys.shape, (5, 2))
        self.assertEqual(len({tuple(np.asarray(x)) for x in keys}), 5)
        for bad in (0, -1, 2.0):
            with self.assertRaises(ValueError):
                r.split_key(bad)

    def test_backup_restore_clone(self):
        r = RandomState(1)
        r.backup_key()
        saved = np.asarray(r.value)
        r.split_key()
        r.restore_key()
        np.testing.assert_array_equal(r.value, saved)
        c = r.clone()
        self.assertIsInstance(c, RandomState)
        self.assertFalse(np.array_equal(c.value, r.value))
        with self.assertRaises(ValueError):
            RandomState(0).restore_key()

    def test_draws_inside_traced_function_thread_the_key(self):
        rng = RandomState(0, name='rng')
        sf = StatefulFunction(lambda: jax.random.normal(rng.split_key(), (3,)))
        jaxpr = sf.get_jaxpr()
        self.assertEqual(len(jaxpr.jaxpr.invars), 1)       # the key is an input ...
        self.assertEqual(len(jaxpr.jaxpr.outvars), 2)      # ... and a written output
        self.assertEqual(len(jaxpr.consts), 0)
        ref = RandomState(0)
        expected = [jax.random.normal(ref.split_key(), (3,)) for _ in range(2)]
        got = [sf(), sf()]
        for e, g in zip(expected, got):
            np.testing.assert_allclose(e, g, rtol=1e-6)
        self.assertFalse(np.allclose(got[0], got[1]))
        np.testing.assert_array_equal(rng.value, ref.value)


# ---------------------------------------------------------------------------
# The trace stack
# ---------------------------------------------------------------------------

class StateTraceStackTest(unittest.TestCase):

    def test_first_touch_order_and_writes(self):
        a, b, c = State(1.0), State(2.0), State(3.0)
        with StateTraceStack() as st:
            b.value = a.value + c.value     # a and c are read before b is written
            _ = a.value
        self.assertEqual(st.states, [a, c, b])
        self.assertEqual(st.been_writen, [False, False, True])
        self.assertEqual(b.value, 4.0)

    def test_exits_must_be_lifo(self):
        s1, s2 = StateTraceStack('one'), StateTraceStack('two')
        s1.__enter__()
        s2.__enter__()
        with self.assertRaisesRegex(RuntimeError, 'out of order'):
            s1.__exit__(None, None, None)
        s2.__exit__(None, None, None)
        self.assertEqual(sj._ctx.frames, [])

    def test_nested_read_visible_to_enclosing(self):
        a = State(1.0)
        with StateTraceStack() as outer:
            with StateTraceStack() as inner:
                _ = a.value
        self.assertEqual(outer.states, [a])
        self.assertEqual(inner.states, [a])

    def test_thread_local(self):
        a = State(1.0)
        seen = []

        def other():
            with StateTraceStack() as st:
                _ = a.value
            seen.append(st.states)
        with StateTraceStack() as mine:
            t = threading.Thread(target=other)
            t.start()
            t.join()
        self.assertEqual(mine.states, [])
        self.assertEqual(seen, [[a]])

    def test_queries(self):
        a, b = State(1.0), State(2.0)
        with StateTraceStack() as st:
            b.value = a.value + 1
        self.assertEqual(st.get_state_values(), [1.0, 2.0])
        self.assertEqual(st.get_state_values(separate=True), ([1.0], [2.0]))
        self.assertEqual(st.get_state_values(separate=True, replace=True),
                         ([1.0, None], [None, 2.0]))
        self.assertEqual(st.get_read_states(), [a])
        self.assertEqual(st.get_read_states(replace_writen=True), [a, None])
        self.assertEqual(st.get_read_state_values(), [1.0])
        self.assertEqual(st.get_write_states(), [b])
        self.assertEqual(st.get_write_states(replace_read=True), [None, b])
        self.assertEqual(st.get_write_state_values(replace_read=True), [None, 2.0])

    def test_recovery_and_assign(self):
        a, b = State(1.0), State(2.0)
        with StateTraceStack() as st:
            b.value = a.value + 10
        st.recovery_original_values()
        self.assertEqual((a.value, b.value), (1.0, 2.0))
        st.assign_state_vals([5.0, 6.0])
        self.assertEqual((a.value, b.value), (5.0, 6.0))
        st.assign_state_vals_v2([7.0, None], [None, 8.0])
        self.assertEqual((a.value, b.value), (7.0, 8.0))
        with self.assertRaises(ValueError):
            st.assign_state_vals([1.0])

    def test_merge_and_subset(self):
        a, p = State(1.0), sj.ParamState(2.0)
        with StateTraceStack() as s1:
            _ = a.value
        with StateTraceStack() as s2:
            a.value = p.value
        merged = s1 + s2
        self.assertEqual(merged.states, [a, p])
        self.assertEqual(merged.been_writen, [True, False])
        self.assertEqual(s1.merge(s2).states, [a, p])
        self.assertEqual(merged.state_subset(sj.ParamState), [p])

    def test_new_arg_keeps_values_in_the_trace(self):
        a = State(1.0)
        with StateTraceStack(new_arg=lambda state, v: v + 100) as st:
            self.assertEqual(a.value, 101.0)
            a.value = 5.0
            self.assertEqual(a.value, 5.0)
        self.assertEqual(a.value, 1.0)           # the State itself never changed
        self.assertEqual(st.been_writen, [True])


# ---------------------------------------------------------------------------
# Cache and key helpers
# ---------------------------------------------------------------------------

class BoundedCacheTest(unittest.TestCase):

    def test_basic_operations(self):
        c = sj.BoundedCache(maxsize=2)
        self.assertIs(sj._BoundedCache, sj.BoundedCache)
        c.set('a', 1)
        c.set('b', 2)
        self.assertIn('a', c)
        self.assertEqual(len(c), 2)
        self.assertEqual(c.get('a'), 1)
        c.set('c', 3)                              # evicts 'b' (least recently used)
        self.assertEqual(sorted(c.keys()), ['a', 'c'])
        c.replace('a', 10)
        self.assertEqual(c.get('a'), 10)
        self.assertEqual(c.pop('a'), 10)
        self.assertIsNone(c.get('zz'))
        self.assertEqual(c.get('zz', default=5), 5)

    def test_messages(self):
        c = sj.BoundedCache()
        c.set('k', 1)
        with self.assertRaisesRegex(ValueError, 'Cache key already exists'):
            c.set('k', 2)
        with self.assertRaisesRegex(KeyError, 'Cache key does not exist'):
            c.replace('missing', 1)
        with self.assertRaises(ValueError) as cm:
            c.get('other', raise_on_miss=True, error_context='Widget')
        text = str(cm.exception)
        for part in ('Widget not compiled for the requested cache key', 'Requested key:',
                     "'other'", 'Available', "'k'", 'make_jaxpr()'):
            self.assertIn(part, text)
        c.clear()
        with self.assertRaisesRegex(ValueError, 'none'):
            c.get('x', raise_on_miss=True)

    def test_stats(self):
        c = sj.BoundedCache(maxsize=4)
        self.assertEqual(c.get_stats()['hit_rate'], 0.0)
        c.set('a', 1)
        c.get('a')
        c.get('a')
        c.get('b')
        stats = c.get_stats()
        self.assertEqual((stats['hits'], stats['misses'], stats['size'], stats['maxsize']),
                         (2, 1, 1, 4))
        self.assertAlmostEqual(stats['hit_rate'], 200 / 3)
        c.clear()
        self.assertEqual(c.get_stats(), {'size': 0, 'maxsize': 4, 'hits': 0, 'misses': 0,
                                         'hit_rate': 0.0})

    def test_maxsize_validation(self):
        for bad in (0, -1, 1.5, 'x', True):
            with self.assertRaises(ValueError, msg=repr(bad)):
                sj.BoundedCache(bad)

    def test_thread_safety(self):
        c = sj.BoundedCache(maxsize=50)

        def work(i):
            for j in range(200):
                k = (i, j % 60)
                if c.get(k) is None:
                    try:
                        c.set(k, j)
                    except ValueError:
                        pass
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertLessEqual(len(c), 50)
        stats = c.get_stats()
        self.assertEqual(stats['hits'] + stats['misses'], 8 * 200)

    def test_make_hashable(self):
        self.assertEqual(sj.make_hashable([1, [2, 3]]), (1, (2, 3)))
        self.assertEqual(sj.make_hashable({'b': 1, 'a': [2]}), (('a', (2,)), ('b', 1)))
        self.assertEqual(sj.make_hashable({1, 2}), frozenset({1, 2}))
        self.assertEqual(sj.make_hashable('s'), 's')
        once = sj.make_hashable({'a': [1, {2}]})
        self.assertEqual(sj.make_hashable(once), once)
        hash(once)

    def test_hashabledict(self):
        a = sj.hashabledict(x=1, y=(2,))
        b = sj.hashabledict(y=(2,), x=1)
        self.assertIsInstance(a, dict)
        self.assertEqual(hash(a), hash(b))
        self.assertEqual({a: 1}[b], 1)
        with self.assertRaises(TypeError):
            a['z'] = 3


# ---------------------------------------------------------------------------
# StatefulFunction: tracing
# ---------------------------------------------------------------------------

def _invar_count(closed):
    return len(closed.jaxpr.invars)


class TracingTest(unittest.TestCase):

    def test_states_become_inputs_and_written_outputs(self):
        a, b, c = State(jnp.ones(2), name='a'), State(jnp.zeros(()), name='b'), State(3.0)

        def f(x, y=1.0):
            b.value = (a.value * x).sum() + y
            return c.value * 2
        sf = StatefulFunction(f)
        closed = sf.get_jaxpr(jnp.ones(2), y=2.0)
        self.assertEqual(sf.get_states(jnp.ones(2), y=2.0), (a, b, c))   # first touch
        self.assertEqual(_invar_count(closed), 2 + 3)     # x, y, then a b c
        self.assertEqual(len(closed.jaxpr.outvars), 1 + 1)  # out, then b
        self.assertEqual(sf.get_write_states(jnp.ones(2), y=2.0), (b,))
        self.assertEqual(sf.get_read_states(jnp.ones(2), y=2.0), (a, c))
        self.assertEqual(len(closed.consts), 0)
        avals = [v.aval for v in closed.jaxpr.invars]
        self.assertEqual(avals[2].shape, (2,))

    def test_return_only_write_false_returns_all(self):
        a, b = State(1.0), State(2.0)

        def f():
            b.value = a.value + 1
            return ()
        closed = StatefulFunction(f, return_only_write=False).get_jaxpr()
        self.assertEqual(len(closed.jaxpr.outvars), 2)
        _, state_shapes = StatefulFunction(f, return_only_write=False).get_out_shapes()
        self.assertEqual(len(state_shapes), 2)

    def _assert_lifted(self, fun, *args, n_states=1):
        closed = StatefulFunction(fun).get_jaxpr(*args)
        n_args = len(jax.tree_util.tree_leaves(args))
        self.assertEqual(_invar_count(closed), n_args + n_states, str(closed))
        for c in closed.consts:       # the state's value was not baked in
            self.assertNotEqual(np.shape(c), (7,))
        return closed

    def test_first_read_inside_scan_cond_while_is_lifted(self):
        s = State(jnp.arange(7.0), name='s')
        self._assert_lifted(
            lambda xs: lax.scan(lambda c, x: (c + s.value * x, None), jnp.zeros(7), xs)[0],
            jnp.ones(3))
        self._assert_lifted(lambda p: lax.cond(p, lambda: s.value, lambda: -s.value), True)
        self._assert_lifted(
            lambda n: lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] + s.value),
                                     (0, jnp.zeros(7)))[1], 3)
        self._assert_lifted(
            lambda n: lax.fori_loop(0, n, lambda i, c: c + s.value, jnp.zeros(7)), 3)

    def test_first_read_inside_grad_vmap_jit_is_lifted(self):
        s = State(jnp.arange(7.0), name='s')
        self._assert_lifted(lambda x: jax.grad(lambda y: (y * s.value).sum())(x), 1.0)
        self._assert_lifted(lambda x: jax.vmap(lambda y: y + s.value.sum())(x), jnp.ones(4))
        self._assert_lifted(lambda x: jax.jit(lambda y: y * s.value)(x), 1.0)
        sf = StatefulFunction(lambda x: jax.jit(lambda y: y * s.value)(x))
        np.testing.assert_allclose(sf(2.0), 2 * np.arange(7.0))
        s.value = jnp.ones(7)          # not baked in: the new value is used
        np.testing.assert_allclose(sf(2.0), 2 * np.ones(7))

    def test_write_inside_nested_transform_is_rejected(self):
        s = State(jnp.zeros(()), name='inner_write')

        def f(xs):
            def body(c, x):
                s.value = s.value + x
                return c, None
            return lax.scan(body, 0.0, xs)[0]
        with self.assertRaisesRegex(TraceContextError, "'inner_write'.*transformation"):
            StatefulFunction(f)(jnp.ones(3))
        self.assertEqual(float(s.value), 0.0)
        self.assertFalse(_tracer_in(s))

    def test_kwargs_follow_positional_args(self):
        s = State(1.0)
        closed = StatefulFunction(lambda x, *, k: x + k + s.value).get_jaxpr(
            jnp.ones(2), k=jnp.zeros(3) [:1])
        shapes = [v.aval.shape for v in closed.jaxpr.invars]
        self.assertEqual(shapes, [(2,), (1,), ()])

    def test_pytree_states(self):
        s = State({'w': jnp.ones(2), 'b': (jnp.zeros(()), jnp.zeros(3))}, name='tree')

        def f(x):
            s.value = jax.tree_util.tree_map(lambda v: v + x, s.value)
            return s.value['w'].sum()
        sf = StatefulFunction(f)
        self.assertEqual(float(sf(1.0)), 4.0)
        self.assertEqual(_invar_count(sf.get_jaxpr(1.0)), 1 + 3)
        np.testing.assert_array_equal(s.value['b'][1], np.ones(3))


# ---------------------------------------------------------------------------
# StatefulFunction: caching
# ---------------------------------------------------------------------------

class CachingTest(unittest.TestCase):

    def test_hit_never_reruns_python(self):
        calls = []
        s = State(jnp.zeros(2))

        def f(x):
            calls.append(1)
            s.value = s.value + x
            return s.value
        sf = StatefulFunction(f)
        for _ in range(5):
            sf(jnp.ones(2))
        sf.get_jaxpr(jnp.ones(2))
        sf.jaxpr_call([s.value], jnp.ones(2))
        self.assertEqual(len(calls), 1)
        np.testing.assert_array_equal(s.value, 5 * np.ones(2))
        sf(jnp.ones(3)[:2] * 0)     # same signature, different values: still cached
        self.assertEqual(len(calls), 1)
        sf(1.0)                     # new signature
        self.assertEqual(len(calls), 2)
        stats = sf.get_cache_stats()['jaxpr_cache']
        self.assertEqual(stats['size'], 2)
        self.assertEqual(stats['misses'], 2)

    def test_key_parts(self):
        sf = StatefulFunction(lambda x, n, flag=False: x * n, static_argnums=1,
                              static_argnames='flag')
        k1 = sf.get_arg_cache_key(jnp.ones(2), 3)
        k2 = sf.get_arg_cache_key(jnp.zeros(2), 3)
        k3 = sf.get_arg_cache_key(jnp.ones(2), 4)
        k4 = sf.get_arg_cache_key(jnp.ones(2, jnp.int32), 3)
        k5 = sf.get_arg_cache_key(jnp.ones(2), 3, flag=True)
        k6 = sf.get_arg_cache_key(1.0, 3)                       # weak type
        k7 = sf.get_arg_cache_key(jnp.float32(1.0), 3)
        self.assertEqual(k1, k2)
        self.assertEqual(len({k1, k3, k4, k5, k6, k7}), 6)
        self.assertIsInstance(k1, sj.hashabledict)
        self.assertEqual(set(k1), {'static_args', 'dyn_args', 'static_kwargs', 'dyn_kwargs'})
        with self.assertRaises(TypeError):
            k1['static_args'] = ()
        self.assertEqual(len(sf._cache), 0)
        sf.get_arg_cache_key(jnp.ones(2), 3, compile_if_miss=True)
        self.assertEqual(len(sf._cache), 1)

    def test_negative_static_argnums(self):
        calls = []

        def f(x, n):
            calls.append(n)
            return x * n
        sf = StatefulFunction(f, static_argnums=-1)
        self.assertEqual(float(sf(2.0, 3)), 6.0)
        self.assertEqual(float(sf(2.0, 4)), 8.0)
        self.assertEqual(float(sf(5.0, 3)), 15.0)
        self.assertEqual(calls, [3, 4])
        self.assertEqual(sf.get_arg_cache_key(1.0, 3), sf.get_arg_cache_key(2.0, 3))

    def test_static_args_by_value(self):
        calls = []

        def f(x, cfg):
            calls.append(1)
            return x * len(cfg['layers'])
        sf = StatefulFunction(f, static_argnums=1)
        self.assertEqual(float(sf(1.0, {'layers': [1, 2]})), 2.0)
        self.assertEqual(float(sf(1.0, {'layers': [1, 2]})), 2.0)
        self.assertEqual(len(calls), 1)
        with self.assertRaisesRegex(TypeError, 'static positional argument 1.*hashable'):
            sf(1.0, np.ones(3))

    def test_stale_state_is_retraced(self):
        calls = []
        s = State(jnp.ones(2), name='grows')

        def f(x):
            calls.append(1)
            s.value = s.value * x
            return s.value.sum()
        sf = StatefulFunction(f)
        self.assertEqual(float(sf(2.0)), 4.0)
        key = sf.get_arg_cache_key(2.0)
        self.assertTrue(sf.validate_states(key))
        s.value = jnp.ones(5)
        with self.assertRaisesRegex(ValueError, "'grows'"):
            sf.validate_states(key)
        self.assertIsInstance(sf.validate_all_states()[key], str)
        self.assertEqual(float(sf(2.0)), 10.0)
        self.assertEqual(len(calls), 2)
        s.value = jnp.ones(5, jnp.float16)        # a dtype change is stale too
        self.assertEqual(float(sf(2.0)), 10.0)
        self.assertEqual(len(calls), 3)
        self.assertEqual(sf.validate_all_states(), {key: True})

    def test_by_cache_accessors(self):
        s = State(jnp.zeros(2), name='s')

        def f(x):
            s.value = s.value + x
            return {'out': x * 2}
        sf = StatefulFunction(f)
        x = jnp.ones(2)
        self.assertIs(sf.make_jaxpr(x), sf)
        key = sf.get_arg_cache_key(x)
        self.assertIs(sf.get_jaxpr_by_cache(key), sf.get_jaxpr(x))
        out_shapes, state_shapes = sf.get_out_shapes_by_cache(key)
        self.assertEqual(out_shapes['out'].shape, (2,))
        self.assertEqual(state_shapes[0].shape, (2,))
        self.assertEqual(sf.get_out_treedef_by_cache(key),
                         jax.tree_util.tree_structure({'out': 0}))
        self.assertEqual(sf.get_states_by_cache(key), (s,))
        self.assertEqual(sf.get_write_states_by_cache(key), (s,))
        self.assertEqual(sf.get_read_states_by_cache(key), ())
        self.assertEqual(sf.get_state_trace_by_cache(key).states, [s])
        bogus = sj.hashabledict(static_args=(), dyn_args=(), static_kwargs=(), dyn_kwargs=())
        for getter, context in ((sf.get_jaxpr_by_cache, 'JAX expression'),
                                (sf.get_out_shapes_by_cache, 'Output shapes'),
                                (sf.get_out_treedef_by_cache, 'Output tree'),
                                (sf.get_state_trace_by_cache, 'State trace'),
                                (sf.get_states_by_cache, 'State trace')):
            with self.assertRaisesRegex(ValueError, '(?s)' + context + '.*Available.*make_jaxpr'):
                getter(bogus)
        with self.assertRaisesRegex(ValueError, 'JAX expression not compiled'):
            sf.get_jaxpr(jnp.ones(3), compile_if_miss=False)

    def test_constructor_attributes_and_clear_cache(self):
        sf = StatefulFunction(lambda x: x, static_argnums=(), static_argnames=(), name='nm',
                              return_only_write=False)
        for attr in ('fun', 'static_argnums', 'static_argnames', 'axis_env',
                     'abstracted_axes', 'name', 'return_only_write'):
            self.assertTrue(hasattr(sf, attr))
        self.assertEqual(sf.name, 'nm')
        sf(1.0)
        sf(1.0)
        stats = sf.get_cache_stats()
        self.assertEqual(set(stats), {'jaxpr_cache', 'out_shapes_cache',
                                      'jaxpr_out_tree_cache', 'state_trace_cache'})
        self.assertEqual(stats['jaxpr_cache']['size'], 1)
        sf.clear_cache()
        for v in sf.get_cache_stats().values():
            self.assertEqual(v['size'], 0)
        self.assertEqual(float(sf(3.0)), 3.0)

    def test_lru_bounds_entries(self):
        sf = StatefulFunction(lambda x: x + 1)
        sf._cache = sj.BoundedCache(maxsize=3)
        for n in range(1, 7):
            sf(jnp.ones(n))
        self.assertEqual(len(sf._cache), 3)
        np.testing.assert_array_equal(sf(jnp.ones(1)), 2 * np.ones(1))


# ---------------------------------------------------------------------------
# StatefulFunction: calling and composing
# ---------------------------------------------------------------------------

class _BindSpy:
    """Counts Python-level binds of ``lax.add_p`` (op-by-op evaluation)."""

    def __enter__(self):
        self.count = 0
        prim = lax.add_p
        original = prim.bind

        def spy(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        prim.bind = spy
        return self

    def __exit__(self, *exc):
        del lax.add_p.bind


class CallingTest(unittest.TestCase):

    def test_call_updates_written_states_only(self):
        w, r = State(jnp.zeros(2), name='w'), State(jnp.ones(2), name='r')
        r_before = r.value

        def f(x):
            w.value = w.value + r.value * x
            return w.value.sum()
        sf = StatefulFunction(f)
        self.assertEqual(float(sf(2.0)), 4.0)
        self.assertEqual(float(sf(2.0)), 8.0)
        self.assertIs(r.value, r_before)
        self.assertEqual(float(sf.jaxpr_call_auto(1.0)), 10.0)

    def test_warm_call_is_compiled_not_op_by_op(self):
        s = State(jnp.zeros(3))

        def f(x):
            s.value = s.value + x + 1.0
            return s.value
        sf = StatefulFunction(f)
        sf(jnp.ones(3))
        with _BindSpy() as spy:
            sf(jnp.ones(3))
            sf(jnp.ones(3))
        self.assertEqual(spy.count, 0)
        with _BindSpy() as spy, jax.disable_jit():
            out = sf(jnp.ones(3))
        self.assertGreater(spy.count, 0)
        np.testing.assert_array_equal(out, 8 * np.ones(3))

    def test_asynchronous_dispatch_result_is_array(self):
        sf = StatefulFunction(lambda x: x * 2)
        self.assertIsInstance(sf(jnp.ones(2)), jax.Array)

    def test_jaxpr_call_is_pure(self):
        s = State(jnp.ones(()), name='acc')
        t = State(jnp.full((), 5.0))

        def f(x):
            s.value = s.value * x + t.value
            return x
        sf = StatefulFunction(f)
        new, out = sf.jaxpr_call([jnp.ones(()), jnp.zeros(())], 3.0)
        self.assertEqual([float(v) for v in new], [3.0, 0.0])
        self.assertEqual(float(s.value), 1.0)
        with self.assertRaisesRegex(ValueError, 'State length mismatch'):
            sf.jaxpr_call([jnp.ones(())], 3.0)
        with self.assertRaisesRegex(ValueError, "'acc'.*shape"):
            sf.jaxpr_call([jnp.ones(4), jnp.zeros(())], 3.0)

    def test_jaxpr_call_under_grad_with_written_states(self):
        s = State(jnp.ones(()), name='s')

        def f(x):
            s.value = s.value * x
            return s.value * x
        sf = StatefulFunction(f)

        def loss(x, sv):
            new, out = sf.jaxpr_call([sv], x)
            return out + new[0]
        g = jax.grad(loss)(2.0, jnp.ones(()))       # d/dx (x^2 + x) at sv=1
        self.assertAlmostEqual(float(g), 5.0)
        g = jax.jit(jax.grad(loss, argnums=1))(2.0, jnp.ones(()))
        self.assertAlmostEqual(float(g), 6.0)
        vm = jax.vmap(lambda x: sf.jaxpr_call([jnp.ones(())], x)[1])(jnp.arange(3.0))
        np.testing.assert_allclose(vm, np.arange(3.0) ** 2)

    def test_read_only_call_under_plain_transforms(self):
        w = State(jnp.array([1.0, 2.0]), name='w')
        sf = StatefulFunction(lambda x: jnp.sum(w.value * x ** 2))
        self.assertAlmostEqual(float(jax.jit(lambda x: sf(x))(jnp.ones(2))), 3.0)
        g = jax.grad(lambda x: sf(x))(jnp.ones(2))
        g_pure = jax.grad(lambda x: jnp.sum(jnp.array([1.0, 2.0]) * x ** 2))(jnp.ones(2))
        np.testing.assert_allclose(g, g_pure)
        np.testing.assert_allclose(jax.vmap(sf)(jnp.ones((3, 2))), 3 * np.ones(3))

    def test_writing_call_under_plain_transform_raises(self):
        s = State(jnp.zeros(()), name='counter')

        def f(x):
            s.value = s.value + x
            return x
        sf = StatefulFunction(f)
        for transform in (jax.jit, jax.grad):
            with self.assertRaisesRegex(TraceContextError, "'counter'.*jaxpr_call"):
                transform(lambda x: sf(x))(1.0)
            self.assertEqual(float(s.value), 0.0)
            self.assertFalse(_tracer_in(s))
        self.assertEqual(float(sf(2.0)), 2.0)   # and still works afterwards
        self.assertEqual(float(s.value), 2.0)

    def test_nested_stateful_functions_compose(self):
        s = State(jnp.zeros(()), name='s')
        r = State(jnp.full((), 10.0), name='r')

        def inner_f(x):
            s.value = s.value + x + r.value
            return s.value
        inner = StatefulFunction(inner_f)

        def outer_f(x):
            a = inner(x)
            b = inner(2 * x)
            return a + b
        outer = StatefulFunction(outer_f)
        closed = outer.get_jaxpr(1.0)
        self.assertEqual(set(outer.get_states(1.0)), {s, r})
        self.assertEqual(outer.get_write_states(1.0), (s,))
        self.assertEqual(len(closed.jaxpr.invars), 3)
        self.assertEqual(float(outer(1.0)), 11.0 + 23.0)
        self.assertEqual(float(s.value), 23.0)
        self.assertFalse(_tracer_in(s))

    def test_read_only_composition_through_scan_cond_jit(self):
        w = State(jnp.full((), 2.0), name='w')
        reader = StatefulFunction(lambda x: x * w.value)

        def outer_f(xs):
            total = lax.scan(lambda c, x: (c + reader(x), None), 0.0, xs)[0]
            branch = lax.cond(total > 0, lambda: reader(1.0), lambda: reader(-1.0))
            jitted = jax.jit(lambda y: reader(y))(3.0)
            return total + branch + jitted
        outer = StatefulFunction(outer_f)
        self.assertEqual(float(outer(jnp.arange(3.0))), 6.0 + 2.0 + 6.0)
        closed = outer.get_jaxpr(jnp.arange(3.0))
        self.assertEqual(len(closed.jaxpr.invars), 2)     # xs, w: threaded, not baked in
        w.value = jnp.full((), 1.0)
        self.assertEqual(float(outer(jnp.arange(3.0))), 3.0 + 1.0 + 3.0)

    def test_state_created_inside_keeps_no_tracer_silently(self):
        made = []

        def f(x):
            made.append(State(x * 2, name='local'))
            return x
        StatefulFunction(f)(1.0)
        self.assertTrue(_tracer_in(made[0]))
        with self.assertRaisesRegex(TraceContextError, r"'local'.*test_stateful_jaxpr\.py"):
            made[0].value
        self.assertIn('finished trace', repr(made[0]))

    def test_local_state_used_inside_trace(self):
        def f(x):
            tmp = State(x)
            tmp.value = tmp.value + 1
            return tmp.value * 2
        sf = StatefulFunction(f)
        self.assertEqual(float(sf(1.0)), 4.0)
        self.assertEqual(sf.get_states(1.0), ())


# ---------------------------------------------------------------------------
# Failure safety
# ---------------------------------------------------------------------------

class FailureSafetyTest(unittest.TestCase):

    def _check(self, fun, *args, exc=_Boom, states=()):
        sf = StatefulFunction(fun)
        snap = _snapshot(states)
        stats = sf.get_cache_stats()
        with self.assertRaises(exc):
            sf(*args)
        _assert_same(self, states, snap)
        self.assertEqual(sf.get_cache_stats(), stats)
        self.assertEqual(len(sf._cache), 0)
        self.assertEqual(sj._ctx.frames, [])
        return sf

    def test_raise_after_writes(self):
        a, b = State(jnp.ones(2), name='a'), RandomState(0)

        def f(x):
            a.value = a.value + x
            b.split_key()
            raise _Boom
        self._check(f, 1.0, states=[a, b])

    def test_raise_inside_scan_and_grad(self):
        a = State(jnp.ones(2))

        def body(c, x):
            if True:
                raise _Boom
            return c, x

        def f(x):
            a.value = a.value * 2
            return lax.scan(body, a.value, x)
        self._check(f, jnp.ones(3), states=[a])

        def g(x):
            a.value = a.value * 2

            def inner(y):
                raise _Boom
            return jax.grad(inner)(x)
        self._check(g, 1.0, states=[a])

    def test_garbage_collector_resumes_after_tracing(self):
        self.assertTrue(gc.isenabled())

        def f(x):
            self.assertFalse(gc.isenabled())     # paused while tracing
            raise _Boom
        with self.assertRaises(_Boom):
            StatefulFunction(f)(1.0)
        self.assertTrue(gc.isenabled())
        StatefulFunction(lambda x: x)(1.0)
        self.assertTrue(gc.isenabled())

    def test_next_call_works_after_failure(self):
        a = State(jnp.zeros(()))
        fail = [True]

        def f(x):
            a.value = a.value + x
            if fail[0]:
                raise _Boom
            return a.value
        sf = StatefulFunction(f)
        with self.assertRaises(_Boom):
            sf(1.0)
        fail[0] = False
        self.assertEqual(float(sf(1.0)), 1.0)
        self.assertEqual(float(a.value), 1.0)

    def test_state_arguments_and_returns_rejected(self):
        s = State(jnp.ones(2), name='culprit')
        sf = StatefulFunction(lambda *a, **k: 0.0)
        for args, kwargs, where in (((s,), {}, r'argument \[0\]'),
                                    (({'a': [1.0, s]},), {}, r"\['a'\]\[1\]"),
                                    ((), {'k': s}, r"keyword argument \['k'\]")):
            with self.assertRaisesRegex(ValueError, where + r".*'culprit'.*test_stateful"):
                sf(*args, **kwargs)
        with self.assertRaisesRegex(ValueError, r"returned.*'culprit'.*test_stateful"):
            StatefulFunction(lambda: s)()
        with self.assertRaisesRegex(ValueError, r"'culprit'"):
            StatefulFunction(lambda: {'x': [s]})()


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------

class ThreadTest(unittest.TestCase):

    def test_concurrent_first_calls_one_entry_per_key(self):
        s = State(jnp.ones(()), name='scale')
        sf = StatefulFunction(lambda x: x * s.value)
        barrier = threading.Barrier(8)
        errors, results = [], {}

        def work(i):
            try:
                barrier.wait()
                x = jnp.arange(float(i + 1))
                for _ in range(20):
                    results[i] = np.asarray(sf(x))
            except Exception as err:  # pragma: no cover - reported below
                errors.append(err)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        for i in range(8):
            np.testing.assert_array_equal(results[i], np.arange(float(i + 1)))
        stats = sf.get_cache_stats()['jaxpr_cache']
        self.assertEqual(stats['size'], 8)
        self.assertEqual(stats['misses'], 8)
        self.assertEqual(stats['hits'] + stats['misses'], 160)

    def test_tracing_never_exposes_tracers_to_other_threads(self):
        shared = State(jnp.full((), 3.0), name='shared')
        tracing = threading.Event()
        done = threading.Event()
        seen = []

        def slow(x):
            v = shared.value * x
            tracing.set()
            done.wait(5)
            return v
        t = threading.Thread(target=lambda: seen.append(StatefulFunction(slow)(2.0)))
        t.start()
        tracing.wait(5)
        observed = shared.value            # read while the other thread is tracing
        done.set()
        t.join()
        self.assertNotIsInstance(observed, jax.core.Tracer)
        self.assertEqual(float(observed), 3.0)
        self.assertEqual(float(seen[0]), 6.0)


# ---------------------------------------------------------------------------
# make_jaxpr
# ---------------------------------------------------------------------------

class MakeJaxprTest(unittest.TestCase):

    def test_stateless_equals_jax_make_jaxpr(self):
        def f(x, y):
            return jnp.sin(x) * y + jnp.cos(y).sum()
        args = (jnp.ones(3), jnp.ones(3))
        ours, states = sj.make_jaxpr(f)(*args)
        theirs = jax.make_jaxpr(f)(*args)
        self.assertEqual(states, ())
        self.assertEqual([e.primitive.name for e in ours.eqns],
                         [e.primitive.name for e in theirs.eqns])
        self.assertEqual(str(ours), str(theirs))

    def test_return_shape_and_states(self):
        s = State(jnp.zeros(2), name='s')

        def f(x, n):
            s.value = s.value + x * n
            return {'y': s.value.sum()}
        closed, states, shapes = sj.make_jaxpr(f, static_argnames='n', return_shape=True)(
            jnp.ones(2), n=3)
        self.assertEqual(states, (s,))
        self.assertEqual(shapes['y'].shape, ())
        self.assertEqual(len(closed.jaxpr.outvars), 2)      # all states (return_only_write=False)
        closed2, _ = sj.make_jaxpr(f, static_argnums=1)(jnp.ones(2), 3)
        self.assertEqual(len(closed2.jaxpr.invars), 2)

    def test_axis_env(self):
        closed, _ = sj.make_jaxpr(lambda x: x + lax.axis_index('i'), axis_env=[('i', 4)])(1.0)
        self.assertIn('axis_index', str(closed))

    def test_abstracted_axes_where_supported(self):
        s = State(jnp.zeros(()), name='s')

        def f(x):
            s.value = s.value + x.sum()
            return x * 2
        if not sj._MAKE_JAXPR_HAS_ABSTRACTED_AXES:
            with self.assertRaisesRegex(NotImplementedError, 'abstracted_axes'):
                sj.make_jaxpr(f, abstracted_axes=('n',))
            return
        problem = sj._dynamic_shapes_problem()
        if problem is not None:
            with self.assertRaisesRegex(NotImplementedError, 'abstracted_axes'):
                sj.make_jaxpr(f, abstracted_axes=('n',))(jnp.ones(3))
            return
        self.fail('unreachable: dynamic shapes need jax_dynamic_shapes')  # pragma: no cover

    def test_abstracted_axes_with_dynamic_shapes_enabled(self):
        if not sj._MAKE_JAXPR_HAS_ABSTRACTED_AXES:
            self.skipTest('jax.make_jaxpr has no abstracted_axes on this JAX')
        s = State(jnp.zeros(()), name='s')

        def f(x):
            s.value = s.value + x.sum()
            return x * 2
        jax.config.update('jax_dynamic_shapes', True)
        try:
            try:
                closed, states = sj.make_jaxpr(f, abstracted_axes=('n',))(jnp.ones(3))
            except NotImplementedError as err:     # JAX 0.7.x: dynamic shapes are broken
                self.assertIn('abstracted_axes', str(err))
                return
        finally:
            jax.config.update('jax_dynamic_shapes', False)
        self.assertEqual(states, (s,))
        self.assertEqual(len(closed.jaxpr.invars), 3)       # n, x:f32[n], s
        self.assertIn('[a]', str(closed).replace(' ', ''))


# ---------------------------------------------------------------------------
# The module itself
# ---------------------------------------------------------------------------

class ModuleTest(unittest.TestCase):

    def test_all_names_exported(self):
        for name in ('State', 'ShortTermState', 'LongTermState', 'ParamState', 'BatchState',
                     'HiddenState', 'RandomState', 'StateTraceStack', 'BoundedCache',
                     'make_hashable', 'hashabledict', 'StatefulFunction', 'make_jaxpr',
                     'StatefulMapping', 'to_predicate', 'OfType', 'Any', 'All', 'Not',
                     'Everything', 'Nothing', 'constant_fold_jaxpr', 'IdentitySet',
                     'TraceContextError', 'BatchAxisError', 'catch_new_states',
                     'check_state_value_tree'):
            self.assertIn(name, sj.__all__)
            obj = getattr(sj, name)
            self.assertTrue(obj.__doc__, name)

    def test_docstring_examples(self):
        import doctest
        result = doctest.testmod(sj, extraglobs={'jax': jax, 'jnp': jnp, 'np': np},
                                 optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        self.assertGreater(result.attempted, 40)
        self.assertEqual(result.failed, 0)

    def test_internals_only_in_compat_section(self):
        with open(sj.__file__) as fh:
            source = fh.read()
        start = source.index('# 1. Compatibility shims')
        end = source.index('# 2. Errors and small helpers')
        outside = source[:start] + source[end:]
        pattern = re.compile(r'jax\._src|jax\.interpreters|jax\.extend|_src_core|\._trace\b|'
                             r'\._pe\b|_lu\.|_siu\.')
        offending = [line for line in outside.splitlines() if pattern.search(line)]
        self.assertEqual(offending, [])

    def test_import_has_no_deprecation_warnings(self):
        code = 'import stateful_jaxpr'
        proc = subprocess.run([sys.executable, '-W', 'error::DeprecationWarning', '-c', code],
                              cwd=HERE, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def test_demo_runs(self):
        proc = subprocess.run([sys.executable, '-W', 'error::DeprecationWarning',
                               'stateful_jaxpr.py'], cwd=HERE, capture_output=True, text=True,
                              timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for part in ("state 'trace' (read)", "state 'count' (written)", 'argument 0',
                     'cache statistics', 'hit_rate', 'StatefulMapping'):
            self.assertIn(part, proc.stdout)

    def test_readme_examples_run(self):
        with open(os.path.join(HERE, 'README.md')) as fh:
            blocks = re.findall(r'```python\n(.*?)```', fh.read(), re.S)
        self.assertGreaterEqual(len(blocks), 4)
        for i, block in enumerate(blocks):
            with self.subTest(block=i):
                exec(compile(block, f'README.md block {i}', 'exec'), {})

    def test_readme_commands(self):
        with open(os.path.join(HERE, 'README.md')) as fh:
            readme = fh.read()
        self.assertIn('python stateful_jaxpr.py', readme)
        self.assertIn('python -W error::DeprecationWarning -m unittest -v test_stateful_jaxpr',
                      readme)
        with open(os.path.join(HERE, '.ci', 'run')) as fh:
            self.assertIn('-W error::DeprecationWarning -m unittest -v test_stateful_jaxpr',
                          fh.read())


if __name__ == '__main__':
    unittest.main()
