#!/usr/bin/env python
# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""Many devices: sharded states and donated buffers, against plain JAX.

Usage::

    python benchmarks/sharding.py            # both rows
    python benchmarks/sharding.py --quick    # smaller budgets

* sharded warm call -- 8 simulated CPU devices; N float32[8192] states sharded
  ``P('d')``, each updated ``s = 0.9 * s + x.sum()``.  Ours:
  ``StatefulFunction(f, donate_states=True)(x)`` on a cache hit.  Baseline:
  ``jax.jit`` of the pure function with explicit ``in_shardings`` /
  ``out_shardings`` and ``donate_argnums`` for the state list.  Interleaved
  blocks, median µs per blocked call; target ratio <= 1.2 at N = 10 and 100.
* donation memory -- one float32 state of 1 GiB updated 5 times
  (``s = 0.5 * s + x``), each side in a fresh process: the peak resident set
  (VmHWM) above the process's resident set before the state existed.  Ours
  with and without ``donate_states=True``, and plain ``jax.jit`` with
  ``donate_argnums``; target with donation <= 1.25x the state's size.

Both rows check that ours and the baseline compute the same values first.
"""

import argparse
import json
import os
import subprocess
import sys

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import jax                       # noqa: E402
import jax.numpy as jnp          # noqa: E402
import numpy as np               # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P   # noqa: E402

from bench import differ, interleaved   # noqa: E402
import stateful_jaxpr as sj      # noqa: E402


def sharded_warm_call(n: int, budget_s: float) -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]), ('d',))
    sharded, replicated = NamedSharding(mesh, P('d')), NamedSharding(mesh, P())
    start = [jax.device_put(jnp.full(8192, float(i)), sharded) for i in range(n)]
    # Donation deletes the states' old buffers: give each side its own copy.
    states = [sj.State(jax.device_put(jnp.copy(v), sharded), name=f's{i}')
              for i, v in enumerate(start)]
    x = jax.device_put(jnp.arange(16.0), replicated)

    def f(x):
        total = x.sum()
        for s in states:
            s.value = 0.9 * s.value + total
        return states[0].value[0]
    ours = sj.StatefulFunction(f, donate_states=True)

    def pure(vals, x):
        total = x.sum()
        new = [0.9 * v + total for v in vals]
        return new, new[0][0]
    base = jax.jit(pure, in_shardings=([sharded] * n, replicated),
                   out_shardings=([sharded] * n, replicated), donate_argnums=0)

    # The same values from both, from the same start.
    out = ours(x)
    new, ref = base(start, x)
    problem = differ('sharded warm call', ([s.value for s in states], out), (new, ref))
    if problem:
        sys.exit(problem)
    if not all(s.value.sharding.is_equivalent_to(sharded, 1) for s in states):
        sys.exit('sharded warm call: a state lost its sharding')
    box = {'vals': new}

    def call_base():
        box['vals'], r = base(box['vals'], x)
        return r
    t = interleaved({'ours': lambda: ours(x), 'jax.jit': call_base}, budget_s, 200, 20000)
    return {'N': n, 'ours_us': t['ours'], 'jit_us': t['jax.jit'],
            'ratio': t['ours'] / t['jax.jit'], 'calls': t['_calls']}


_MEMORY_CHILD = r'''
import json, sys
sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp, numpy as np
import stateful_jaxpr as sj
side, steps, n = sys.argv[1], 5, (1 << 30) // 4

def status(field):
    with open('/proc/self/status') as fh:
        for line in fh:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
jax.block_until_ready(jax.jit(lambda v: 0.5 * v + 1.0)(jnp.ones(8)))   # warm up JAX
base = status('VmRSS')
x = jnp.float32(1.0)
if side == 'jax.jit + donate_argnums':
    step = jax.jit(lambda v, x: 0.5 * v + x, donate_argnums=0)
    v = jnp.zeros(n, jnp.float32)
    for _ in range(steps):
        v = step(v, x)
    out = jax.block_until_ready(v)
else:
    s = sj.State(jnp.zeros(n, jnp.float32), name='big')
    def f(x):
        s.value = 0.5 * s.value + x
        return x
    sf = sj.StatefulFunction(f, donate_states=(side == 'ours, donate_states=True'))
    for _ in range(steps):
        sf(x)
    out = jax.block_until_ready(s.value)
peak = status('VmHWM') - base
print(json.dumps({'side': side, 'peak_over_state': peak / (n * 4),
                  'value': float(out[0]), 'expected': float(2.0 * (1 - 0.5 ** steps))}))
'''


def donation_memory() -> list:
    rows = []
    for side in ('ours, donate_states=True', 'ours, no donation', 'jax.jit + donate_argnums'):
        env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
        done = subprocess.run([sys.executable, '-c', _MEMORY_CHILD, side, os.path.dirname(_HERE)],
                              capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            sys.exit(f'donation memory ({side}) failed:\n{done.stderr}')
        row = json.loads(done.stdout.strip().splitlines()[-1])
        if abs(row['value'] - row['expected']) > 1e-5:
            sys.exit(f'donation memory ({side}): wrong value {row["value"]}')
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='smaller time budgets')
    parser.add_argument('--json', help='also write the results to this file')
    args = parser.parse_args(argv)
    budget = 1.0 if args.quick else 4.0
    print(f'jax {jax.__version__}, {jax.device_count()} devices, python '
          f'{sys.version.split()[0]}')
    print('\nsharded warm call (8 devices, P("d"), donated): median µs per blocked call')
    print(f'{"N":>5} {"ours":>10} {"jax.jit":>10} {"ratio":>7} {"target":>8}')
    warm = []
    for n in (10, 100):
        r = sharded_warm_call(n, budget)
        warm.append(r)
        margin = 1.2 - r['ratio']
        print(f'{n:>5} {r["ours_us"]:>10.1f} {r["jit_us"]:>10.1f} {r["ratio"]:>7.2f} '
              f'{"<= 1.20":>8}  margin {margin:+.2f} ({r["calls"]} calls per side)')
    print('\ndonation memory (1 GiB state, 5 updates): peak RSS above the start / state size')
    memory = donation_memory()
    for r in memory:
        target = '  target <= 1.25' if r['side'] == 'ours, donate_states=True' else ''
        print(f'  {r["side"]:<28} {r["peak_over_state"]:.2f}x{target}')
    if args.json:
        with open(args.json, 'w') as fh:
            json.dump({'warm': warm, 'memory': memory}, fh, indent=2)


if __name__ == '__main__':
    main()
