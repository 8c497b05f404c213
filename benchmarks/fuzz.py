"""Long differential-fuzzing run for stateful_jaxpr.

Random stateful programs are generated from consecutive seeds and run eagerly
(the reference; a differentiated function carries the States it writes by
hand), through ``StatefulFunction``, ``jax.jit`` over ``jaxpr_call``, the
constant-folded jaxpr and ``StatefulMapping``; every path must agree, values
and derivatives.  Prints programs/s, the share of programs exercising each
feature and the seed of any failure so it can be replayed (a refusal the
generator's model does not predict is printed with the test that shows it):

    python benchmarks/fuzz.py                    # 10,000 programs from seed 0
    python benchmarks/fuzz.py --seed 5000 --n 200
    python benchmarks/fuzz.py --replay 5123      # print and rerun one program

The generator, interpreter and checks live in ``test_stateful_jaxpr.py``
(``fuzz_main``), so the unit suite and this runner share one implementation.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from test_stateful_jaxpr import fuzz_main  # noqa: E402

if __name__ == '__main__':
    sys.exit(fuzz_main(sys.argv[1:]))
