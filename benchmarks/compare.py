#!/usr/bin/env python
# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""Compare two versions of ``stateful_jaxpr`` against each other and plain JAX.

Usage::

    python benchmarks/compare.py --before PATH_OR_GITREV [--after PATH] [--quick]

``--before`` is a path to an old ``stateful_jaxpr.py`` or a git revision (its
``stateful_jaxpr.py`` is taken with ``git show REV:stateful_jaxpr.py`` from the
repository root).  ``--after`` defaults to the working tree's
``stateful_jaxpr.py``.  Both files are loaded as separate modules
(``sj_before``, ``sj_after``) in the same process and timed on the same
workloads, next to the same program written in plain JAX.

Method.  Before timing, every workload is run once on each side from the same
start values; results and new state values must match plain JAX
(``numpy.testing.assert_allclose``, rtol 1e-5), or the run stops naming the
row (the first-call programs differ from the checked warm-call program only
in their constant; the scan row checks the compiled call of its program).
Warm rows alternate blocks of calls (before, after, jax, order rotated each
round) for a fixed wall-time budget (about 2 s per side and row, 0.5 s with
``--quick``); each block gives a time per call and the row reports the
median over blocks.  "blocked" rows block on every call; "loop" rows dispatch
100 calls back to back and block once, on the last.  First-call rows
(``make_jaxpr`` of a fresh function, trace + compile + run of a fresh
function) take 7 repetitions (3 with ``--quick``) with the order rotated,
fresh function objects and States each time, and a constant no other program
uses folded into each program, so that nothing is reused from JAX's caches.
The training rows (``training.py``: a LIF network's BPTT step and forward run,
an MLP step) time the first ``make_jaxpr`` likewise; a side that refuses the
workload (its ``TraceContextError``: BPTT before JAX 0.7, or an older module),
fails otherwise, or computes other numbers than plain JAX is shown as such and
not timed.
Ratios below 1 mean the after version is faster.
"""

import argparse
import atexit
import gc
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import training as tr   # benchmarks/training.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = jnp.float32
SIDES = ('before', 'after', 'jax')
_pc = time.perf_counter_ns
_UNIQUE = itertools.count(1)


# -- loading ------------------------------------------------------------------

def module_file(spec: str) -> str:
    """``spec`` if it is a file, else ``stateful_jaxpr.py`` at git revision
    ``spec``, written to a temporary file."""
    if os.path.isfile(spec):
        return os.path.abspath(spec)
    res = subprocess.run(['git', 'show', f'{spec}:stateful_jaxpr.py'], cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode:
        sys.exit(f'compare.py: {spec!r} is neither a file nor a git revision with '
                 f'stateful_jaxpr.py: {res.stderr.strip()}')
    fd, path = tempfile.mkstemp(prefix='stateful_jaxpr_', suffix='.py')
    with os.fdopen(fd, 'w') as fh:
        fh.write(res.stdout)
    atexit.register(os.unlink, path)
    return path


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# -- workloads ----------------------------------------------------------------

def fresh_decay() -> float:
    """0.9 * (1 + k * 1e-6) with a k no other call returns."""
    return 0.9 * (1.0 + next(_UNIQUE) * 1e-6)


def step(states, decay=0.9):
    def f(x):
        for s in states:
            s.value = decay * s.value + x
        return states[0].value.sum()
    return f


def pure_step(decay=0.9):
    def pure(x, vals):
        new = [decay * v + x for v in vals]
        return new[0].sum(), new
    return pure


def scan_step(states, decay=0.9):
    def f(xs):
        def body(c, x):
            for s in states:
                s.value = decay * s.value + x
            return c, None
        jax.lax.scan(body, 0.0, xs)
        return states[0].value.sum()
    return f


def pure_scan(decay=0.9):
    def pure(xs, vals):
        def body(vs, x):
            return [decay * v + x for v in vs], None
        new, _ = jax.lax.scan(body, list(vals), xs)
        return new[0].sum(), new
    return pure


def make_states(mod, n, shape=(16,)):
    return [mod.State(jnp.zeros(shape, F32)) for _ in range(n)]


def warm_sides(mods, n, shape, mapped):
    """``{side: call}`` for the dispatch workload, each side with its own
    States (or value list), plus ``{side: () -> (out, state values)}``."""
    x = jnp.ones(shape, F32)
    calls, peek = {}, {}
    for side, mod in mods.items():
        states = make_states(mod, n, shape)
        if mapped:
            sf = mod.StatefulMapping(step(states), in_axes=0, state_in_axes={0: mod.State})
        else:
            sf = mod.StatefulFunction(step(states))
        calls[side] = lambda sf=sf: sf(x)
        peek[side] = lambda sf=sf, st=states: (sf(x), [s.value for s in st])
    jitted = jax.jit(jax.vmap(pure_step()) if mapped else pure_step())
    box = [[jnp.zeros(shape, F32) for _ in range(n)]]

    def jax_call():
        out, box[0] = jitted(x, box[0])
        return out
    calls['jax'] = jax_call
    peek['jax'] = lambda: (jax_call(), box[0])
    return calls, peek


def check(row, peek):
    """Stops the run unless every side's first call matches plain JAX's."""
    ref_out, ref_vals = peek['jax']()
    for side in ('before', 'after'):
        out, vals = peek[side]()
        try:
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5)
            for v, r in zip(vals, ref_vals, strict=True):
                np.testing.assert_allclose(np.asarray(v), np.asarray(r), rtol=1e-5)
        except (AssertionError, ValueError) as e:
            sys.exit(f'compare.py: {row}: {side} and plain JAX differ, not timing.\n{e}')


# -- timing -------------------------------------------------------------------

def timed_block(call, k, loop):
    """ns per call over ``k`` calls: each blocked, or (``loop``) blocked once."""
    t0 = _pc()
    if loop:
        for _ in range(k - 1):
            call()
        jax.block_until_ready(call())
    else:
        for _ in range(k):
            jax.block_until_ready(call())
    return (_pc() - t0) / k


def interleaved(calls, budget_s, loop):
    """Median over blocks of ns per call for each side, blocks interleaved."""
    names = list(calls)
    for name in names:                     # warm up
        timed_block(calls[name], 20, loop)
    if loop:
        k = 100
    else:
        est = max(timed_block(calls[n], 10, False) for n in names)
        k = max(1, int(20e6 / max(est, 1)))   # blocks of ~20 ms
    samples = {n: [] for n in names}
    gc.collect()
    deadline = _pc() + budget_s * len(names) * 1e9
    for r in itertools.count():
        if r >= 6 and _pc() > deadline:
            break
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(timed_block(calls[name], k, loop))
    return {n: statistics.median(v) for n, v in samples.items()}


def rotating_once(makers, reps):
    """Median ns of one blocked ``makers[side]()()`` per side (the maker
    untimed), ``reps`` times, the order rotated, after a full collection."""
    names = list(makers)
    samples = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call = makers[name]()
            gc.collect()
            t0 = _pc()
            jax.block_until_ready(call())
            samples[name].append(_pc() - t0)
    return {n: statistics.median(v) for n, v in samples.items()}


# -- rows ---------------------------------------------------------------------

def warm_row(mods, label, n, budget, loop=False, mapped=False):
    shape = (64, 16) if mapped else (16,)
    calls, peek = warm_sides(mods, n, shape, mapped)
    check(f'{label} N={n}', peek)
    return interleaved(calls, budget, loop)


def trace_row(mods, n, reps):
    xs = jnp.ones((100, 16), F32)
    zeros = [jnp.zeros(16, F32) for _ in range(n)]
    peek = {}
    for side, mod in mods.items():
        states = make_states(mod, n)
        sf = mod.StatefulFunction(scan_step(states))
        peek[side] = lambda sf=sf, st=states: (sf(xs), [s.value for s in st])
    peek['jax'] = lambda: jax.jit(pure_scan())(xs, zeros)
    check(f'scan make_jaxpr N={n}', peek)

    def ours(mod):
        def make():
            sf = mod.StatefulFunction(scan_step(make_states(mod, n), fresh_decay()))
            return lambda: sf.make_jaxpr(xs) and None
        return make

    def plain():
        mk = jax.make_jaxpr(pure_scan(fresh_decay()))
        return lambda: mk(xs, zeros) and None
    makers = {side: ours(mod) for side, mod in mods.items()} | {'jax': plain}
    return rotating_once(makers, reps)


def first_call_row(mods, n, reps):
    x = jnp.ones(16, F32)
    zeros = [jnp.zeros(16, F32) for _ in range(n)]

    def ours_maker(mod):
        def make():
            sf = mod.StatefulFunction(step(make_states(mod, n), fresh_decay()))
            return lambda: sf(x)
        return make

    def plain():
        jitted = jax.jit(pure_step(fresh_decay()))
        return lambda: jitted(x, zeros)
    makers = {side: ours_maker(mod) for side, mod in mods.items()} | {'jax': plain}
    return rotating_once(makers, reps)


def training_row(mods, kind, reps):
    """First ``make_jaxpr`` of a fresh training workload (``kind``: 'lif_bptt',
    'lif_forward' or 'mlp'), each side checked first; returns the timings and
    ``{side: 'refused' | 'error' | 'differs'}`` for the sides left out (the
    error's first line goes to stderr)."""
    if kind == 'mlp':
        x, y, params = tr.mlp_data()
        args, make_states = (x, y), lambda mod: tr.mlp_states(mod, params)
        step, pure = tr.mlp_step, tr.mlp_pure
    else:
        xs, w = tr.lif_data()
        grad = kind == 'lif_bptt'
        args, make_states = (xs,), lambda mod: tr.lif_states(mod, w)
        step = lambda st, c: tr.lif_step(st, grad, c)  # noqa: E731
        pure = lambda c: tr.lif_pure(grad, c)          # noqa: E731
    c, makers, left_out = fresh_decay(), {}, {}
    for side, mod in mods.items():
        states = make_states(mod)
        values = lambda: jax.tree_util.tree_map(  # noqa: E731
            lambda s: s.value, states, is_leaf=lambda s: isinstance(s, mod.State))
        start = values()
        try:
            got = mod.StatefulFunction(step(states, c))(*args), values()
        except Exception as err:  # noqa: BLE001 - an older module may fail in other ways
            left_out[side] = 'refused' if isinstance(err, mod.TraceContextError) else 'error'
            print(f'{kind}, {side}: {type(err).__name__}: {str(err).splitlines()[0][:200]}',
                  file=sys.stderr)
            continue
        new, out = jax.jit(pure(c))(start, *args)
        got, want = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (got, (out, new)))
        try:
            for (path, a), (_, b) in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                           err_msg=f'(result, states){jax.tree_util.keystr(path)}')
        except (AssertionError, ValueError) as err:
            left_out[side] = 'differs'
            print(f'{kind}, {side} vs plain JAX: {" ".join(str(err).split())[:300]}',
                  file=sys.stderr)
            continue
        makers[side] = lambda mod=mod, states=states: (
            lambda sf: lambda: sf.make_jaxpr(*args) and None)(
                mod.StatefulFunction(step(states, fresh_decay())))
    makers['jax'] = lambda: (lambda mk: lambda: mk(start, *args) and None)(
        jax.make_jaxpr(pure(fresh_decay())))
    return rotating_once(makers, reps), left_out


# -- output -------------------------------------------------------------------

def fmt_time(ns):
    us = ns / 1e3
    return f'{us:9.1f} µs' if us < 1000 else f'{us / 1e3:9.2f} ms'


def print_row(label, t, ratios, left_out=None):
    """One row; a side in ``left_out`` shows why it was not timed."""
    left_out = left_out or {}
    cells = ''.join(f'{left_out[s] if s in left_out else fmt_time(t[s]):>14}' for s in SIDES)
    r_ab = t['after'] / t['before'] if 'after' in t and 'before' in t else None
    r_aj = t['after'] / t['jax'] if 'after' in t else None
    if r_ab is not None:
        ratios.append(r_ab)
    print(f'{label:<34}{cells}' + (f'{r_ab:>14.3f}' if r_ab is not None else ' ' * 14)
          + (f'{r_aj:>11.3f}' if r_aj is not None else ''), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--before', required=True, help='old stateful_jaxpr.py or a git revision')
    ap.add_argument('--after', default=os.path.join(ROOT, 'stateful_jaxpr.py'))
    ap.add_argument('--quick', action='store_true', help='short budgets, fewer repetitions')
    args = ap.parse_args(argv)
    paths = {'before': module_file(args.before), 'after': module_file(args.after)}
    mods = {side: load(path, f'sj_{side}') for side, path in paths.items()}
    for side in ('before', 'after'):
        print(f'{side:<7} {mods[side].__file__}')
    print(f'jax     {jax.__version__} ({jax.default_backend()})')
    budget, reps = (0.5, 3) if args.quick else (2.0, 7)

    print()
    print(f'{"workload":<34}' + ''.join(f'{s:>14}' for s in SIDES)
          + f'{"after/before":>14}{"after/jax":>11}')
    ratios = []
    for n in (1, 10, 100, 1000):
        print_row(f'warm call, blocked  N={n}', warm_row(mods, 'warm call', n, budget), ratios)
    for n in (1, 10):
        print_row(f'warm call, loop     N={n}',
                  warm_row(mods, 'warm loop', n, budget, loop=True), ratios)
    print_row('StatefulMapping, b64 N=10',
              warm_row(mods, 'StatefulMapping', 10, budget, mapped=True), ratios)
    for n in (1, 10):
        print_row(f'scan first make_jaxpr N={n}', trace_row(mods, n, reps), ratios)
    for n in (10, 100):
        print_row(f'first call          N={n}', first_call_row(mods, n, reps), ratios)
    for kind, label in (('lif_bptt', 'LIF BPTT step make_jaxpr'),
                        ('lif_forward', 'LIF forward make_jaxpr'), ('mlp', 'MLP step make_jaxpr')):
        t, left_out = training_row(mods, kind, reps)
        print_row(label, t, ratios, left_out)
    print(f'\nmedian after/before over {len(ratios)} rows: {statistics.median(ratios):.3f}')


if __name__ == '__main__':
    main()
