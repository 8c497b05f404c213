#!/usr/bin/env python
# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""How much of tracing a write inside ``lax.scan`` is JAX's own cost of Refs.

Usage::

    python benchmarks/ref_floor.py [--reps 15] [--sizes 1,10,100]

A State written inside a nested transformation is held as a Ref there: each
read and write is one whole-Ref ``get`` / ``swap`` equation in the body, which
JAX lifts the Ref into, and the discharge turns the result into the program
with the State as a carry.  ``bench.py``'s scan_write rows compare that whole
trace with ``jax.make_jaxpr`` of the explicit-carry program.  This script
splits the difference in two, on the same program (N float32[16] States, each
``s = decay*s + x`` inside a 50-step ``lax.scan``), timing one trace of each
of, interleaved and with a fresh constant per repetition:

* ``ours``: a later trace at new shapes (100 -> 50 steps) of
  ``StatefulFunction(f).make_jaxpr``, as in ``bench.py``;
* ``make_jaxpr``: ``jax.make_jaxpr`` of the explicit-carry program (the
  baseline of ``bench.py``'s targets);
* ``carry``: that program traced by the tracer ``ours`` uses
  (``stateful_jaxpr._trace_to_jaxpr``), without ``jax.make_jaxpr``'s own
  argument handling;
* ``refs``: the Ref program ``ours`` has JAX trace, through the same tracer,
  with the Refs as jaxpr inputs and the reads and writes emitted as ``ours``
  emits them (``stateful_jaxpr._read_ref`` / ``_write_ref``), not discharged.

``refs - carry`` is what tracing through Refs costs JAX itself (lifting each
Ref into the body, the equations and their effects); ``ours - refs`` is what
this module adds (lifting the States, the discharge, the bookkeeping).  Needs
JAX 0.7.2 or newer, where reads and writes are emitted straight into the trace.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax                      # noqa: E402
import jax.numpy as jnp         # noqa: E402

import bench                    # noqa: E402
import stateful_jaxpr as sj     # noqa: E402


def ref_program(n: int, decay: float):
    """flat(*refs, xs) -> [c]: the scan body reads and writes each Ref whole."""
    def flat(*args):
        refs, xs = args[:n], args[n]

        def body(c, x):
            for r in refs:
                sj._write_ref(r, decay * sj._read_ref(r) + x)
            return c + jnp.sum(sj._read_ref(refs[0])), None
        return [jax.lax.scan(body, 0.0, xs)[0]]
    return flat


def carry_program(n: int, decay: float):
    """flat(*vals, xs) -> [c, *new_vals]: bench.nested_pure('scan'), flattened."""
    pure = bench.nested_pure('scan', decay)

    def flat(*args):
        vals, c = pure(list(args[:n]), args[n])
        return [c, *vals]
    return flat


def sides(n: int) -> list:
    xs100, xs50 = jnp.ones((100, 16), jnp.float32), jnp.ones((50, 16), jnp.float32)
    aval, xs_aval = sj._aval_of(jnp.zeros(16, jnp.float32)), sj._aval_of(xs50)
    ref_avals = [sj._ref_type(aval)] * n + [xs_aval]
    val_avals = [aval] * n + [xs_aval]
    states = [sj.State(jnp.zeros(16, jnp.float32)) for _ in range(n)]
    vals = [jnp.zeros(16, jnp.float32)] * n

    def traced(program, avals):
        flat = program(n, bench.fresh_decay())
        return lambda: sj._trace_to_jaxpr(flat, avals, fun=flat, name='flat')

    def ours():
        sf = sj.StatefulFunction(bench.nested_step('scan', states, bench.fresh_decay()))
        sf.make_jaxpr(xs100)
        return lambda: sf.make_jaxpr(xs50)

    def make_jaxpr():
        m = jax.make_jaxpr(bench.nested_pure('scan', bench.fresh_decay()))
        m(vals, xs100)
        return lambda: m(vals, xs50)

    # (name, timed call, untimed preparation): bench.alternating_once's form.
    return [('ours', lambda f: f(), ours), ('make_jaxpr', lambda f: f(), make_jaxpr),
            ('carry', lambda f: f(), lambda: traced(carry_program, val_avals)),
            ('refs', lambda f: f(), lambda: traced(ref_program, ref_avals))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--reps', type=int, default=15)
    parser.add_argument('--sizes', default='1,10,100')
    opts = parser.parse_args()
    if not sj._STAGE_REFS:
        sys.exit(f'jax {jax.__version__}: reads and writes of Refs are bound, not emitted '
                 'straight into the trace; this split applies from JAX 0.7.2')
    print(f'jax {jax.__version__}; later trace of the scan_write program, medians of '
          f'{opts.reps} in µs (ratios against make_jaxpr)')
    for n in (int(s) for s in opts.sizes.split(',')):
        pairs = sides(n)
        bench.alternating_once(pairs, 2)   # warm-up: JAX's first-use costs
        times, _ = bench.alternating_once(pairs, opts.reps)
        m = {name: statistics.median(v) for name, v in times.items()}
        base = m['make_jaxpr']
        shown = '  '.join(f'{k} {v:9.1f} (x{v / base:.2f})' for k, v in m.items())
        print(f'N = {n:4d}: {shown}')
        print(f'          per State: JAX through Refs (refs - carry) '
              f'{(m["refs"] - m["carry"]) / n:6.1f}, this module (ours - refs, its fixed '
              f'costs included) {(m["ours"] - m["refs"]) / n:6.1f}; '
              f'make_jaxpr - carry {base - m["carry"]:.0f} in all')


if __name__ == '__main__':
    main()
