# Copyright 2026 The stateful_jaxpr authors.
# SPDX-License-Identifier: Apache-2.0
"""Two training workloads, written with States and by hand (``bench.py``, ``compare.py``).

* LIF: 400 inputs -> 100 leaky integrate-and-fire neurons over a 1,000-step
  ``lax.scan``.  The weights are a ``ParamState`` read in the scan body, the
  membrane potential a ``HiddenState`` written there, the spike a
  ``jax.custom_vjp`` with a surrogate gradient.  ``grad=True``: one training
  step, ``jax.value_and_grad`` of a spike-rate loss through the whole loop
  (backpropagation through time), then an SGD update of the weights;
  ``grad=False``: the forward simulation alone.
* GRU: 64 inputs -> 256 gated recurrent units, batch 32, over a 200-step
  ``lax.scan`` (matmuls dominate).  The three weights are ``ParamState``s, the
  hidden state a ``HiddenState`` written in the body; one training step is
  ``jax.value_and_grad`` of the mean squared hidden state through the loop,
  then SGD.
* MLP: one training step of a 2-layer MLP (784 -> 256 -> 10, batch 128) with
  BatchNorm whose running statistics are ``BatchState``s updated in the step,
  dropout drawing from a ``RandomState``, and adam (m, v, count held in
  States; a few lines, no optax).  The loss gradient is ``jax.value_and_grad``.

Each builder takes the module (``stateful_jaxpr`` or another version of it),
so that ``compare.py`` can run two versions side by side.  The stateful
version assigns the parameters it differentiates into their ParamStates at
the top of the loss, as users of ``jax.grad`` do.  The explicit version is the
same program with every state an argument and a result.  ``runs`` counts how
often the user's Python ran: ``runs['step']`` the function given to the
StatefulFunction, ``runs['body']`` the scan body (LIF) or the loss (MLP).
Every program folds a constant (``decay`` / ``momentum``) that the caller
makes unique, so that no two timed programs are alike to JAX's caches.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
LIF_IN, LIF_OUT, LIF_T = 400, 100, 1000
MLP_BATCH, MLP_IN, MLP_HIDDEN, MLP_OUT = 128, 784, 256, 10
RATE, LR = 0.05, 1e-3                    # LIF target spike rate, learning rates
B1, B2, EPS, KEEP = 0.9, 0.999, 1e-8, 0.9  # adam, dropout keep probability


def new_runs():
    return collections.Counter()


def surrogate_spike():
    """A Heaviside spike at 1.0 whose gradient is a fast sigmoid's."""
    @jax.custom_vjp
    def spike(v):
        return (v > 1.0).astype(F32)
    spike.defvjp(lambda v: (spike(v), v),
                 lambda v, g: (g / (1.0 + 10.0 * jnp.abs(v - 1.0)) ** 2,))
    return spike


# -- LIF ------------------------------------------------------------------------

def lif_data():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    xs = 0.12 * jax.random.uniform(k1, (LIF_T, LIF_IN), F32)
    w = 0.3 * jax.random.normal(k2, (LIF_IN, LIF_OUT), F32)
    return xs, w


def lif_states(sj, w):
    """``{'w': ParamState, 'v': HiddenState}``: the explicit state's structure."""
    return {'w': sj.ParamState(w, name='lif_w'),
            'v': sj.HiddenState(jnp.zeros(LIF_OUT, F32), name='lif_v')}


def lif_step(st, grad: bool, decay: float = 0.9, runs=None):
    """f(xs) over the States ``st`` (:func:`lif_states`): the training step
    (``grad``, returns the loss and the weights' gradient) or the forward run
    (returns the loss)."""
    runs = new_runs() if runs is None else runs
    spike = surrogate_spike()
    w, v = st['w'], st['v']

    def body(count, x):
        runs['body'] += 1
        u = decay * v.value + x @ w.value
        s = spike(u)
        v.value = u - s                    # reset by subtraction
        return count + s, None

    def loss(xs):
        count = jax.lax.scan(body, jnp.zeros(LIF_OUT, F32), xs)[0]
        return jnp.mean((count / LIF_T - RATE) ** 2)

    def train(xs):
        runs['step'] += 1

        def of_weights(wv):
            w.value = wv
            return loss(xs)
        value, g = jax.value_and_grad(of_weights)(w.value)
        w.value = w.value - LR * g
        return value, g

    def forward(xs):
        runs['step'] += 1
        return loss(xs)
    return train if grad else forward


def lif_pure(grad: bool, decay: float = 0.9, runs=None):
    """pure(state, xs) -> (new_state, out): :func:`lif_step` with
    ``state = {'w': ..., 'v': ...}`` threaded by hand."""
    runs = new_runs() if runs is None else runs
    spike = surrogate_spike()

    def body(carry, x):
        runs['body'] += 1
        count, v, w = carry
        u = decay * v + x @ w
        s = spike(u)
        return (count + s, u - s, w), None

    def loss(w, v, xs):
        count, v, _ = jax.lax.scan(body, (jnp.zeros(LIF_OUT, F32), v, w), xs)[0]
        return jnp.mean((count / LIF_T - RATE) ** 2), v

    def pure(state, xs):
        runs['step'] += 1
        if not grad:
            value, v = loss(state['w'], state['v'], xs)
            return {'w': state['w'], 'v': v}, value
        (value, v), g = jax.value_and_grad(loss, has_aux=True)(state['w'], state['v'], xs)
        return {'w': state['w'] - LR * g, 'v': v}, (value, g)
    return pure


# -- GRU --------------------------------------------------------------------------

GRU_IN, GRU_H, GRU_B, GRU_T = 64, 256, 32, 200
GATES = ('z', 'r', 'n')


def gru_data():
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    xs = jax.random.normal(ks[0], (GRU_T, GRU_B, GRU_IN), F32)
    scale = 1 / np.sqrt(GRU_IN + GRU_H)
    w = {g: scale * jax.random.normal(k, (GRU_IN + GRU_H, GRU_H), F32)
         for g, k in zip(GATES, ks[1:])}
    return xs, w


def gru_states(sj, w):
    """``{'w': {gate: ParamState}, 'h': HiddenState}``: the explicit state's structure."""
    return {'w': {g: sj.ParamState(v, name=f'gru_w{g}') for g, v in w.items()},
            'h': sj.HiddenState(jnp.zeros((GRU_B, GRU_H), F32), name='gru_h')}


def _gru_cell(w, h, x, decay):
    xh = jnp.concatenate([x, h], -1)
    z, r = jax.nn.sigmoid(xh @ w['z']), jax.nn.sigmoid(xh @ w['r'])
    n = jnp.tanh(jnp.concatenate([x, r * h], -1) @ w['n'])
    return (1 - z) * n + decay * z * h


def gru_step(st, decay: float = 0.9, runs=None):
    """f(xs) over the States ``st`` (:func:`gru_states`): one training step,
    returning the loss and the weights' gradients."""
    runs = new_runs() if runs is None else runs
    w, h = st['w'], st['h']

    def body(acc, x):
        runs['body'] += 1
        h.value = _gru_cell({g: s.value for g, s in w.items()}, h.value, x, decay)
        return acc + jnp.mean(h.value ** 2), None

    def step(xs):
        runs['step'] += 1

        def loss(params):
            for g, s in w.items():
                s.value = params[g]
            return jax.lax.scan(body, jnp.zeros((), F32), xs)[0] / GRU_T
        value, g = jax.value_and_grad(loss)({k: s.value for k, s in w.items()})
        for k, s in w.items():
            s.value = s.value - LR * g[k]
        return value, g
    return step


def gru_pure(decay: float = 0.9, runs=None):
    """pure(state, xs) -> (new_state, out): :func:`gru_step` threaded by hand."""
    runs = new_runs() if runs is None else runs

    def body(carry, x):
        runs['body'] += 1
        acc, h, w = carry
        h = _gru_cell(w, h, x, decay)
        return (acc + jnp.mean(h ** 2), h, w), None

    def loss(w, h, xs):
        acc, h, _ = jax.lax.scan(body, (jnp.zeros((), F32), h, w), xs)[0]
        return acc / GRU_T, h

    def pure(state, xs):
        runs['step'] += 1
        (value, h), g = jax.value_and_grad(loss, has_aux=True)(state['w'], state['h'], xs)
        new_w = {k: v - LR * g[k] for k, v in state['w'].items()}
        return {'w': new_w, 'h': h}, (value, g)
    return pure


# -- MLP --------------------------------------------------------------------------

PARAMS = ('w1', 'b1', 'gamma', 'beta', 'w2', 'b2')


def mlp_data():
    ks = jax.random.split(jax.random.PRNGKey(2), 4)
    x = jax.random.normal(ks[0], (MLP_BATCH, MLP_IN), F32)
    y = jax.random.randint(ks[1], (MLP_BATCH,), 0, MLP_OUT)
    params = {
        'w1': jax.random.normal(ks[2], (MLP_IN, MLP_HIDDEN), F32) / np.sqrt(MLP_IN),
        'b1': jnp.zeros(MLP_HIDDEN, F32),
        'gamma': jnp.ones(MLP_HIDDEN, F32), 'beta': jnp.zeros(MLP_HIDDEN, F32),
        'w2': jax.random.normal(ks[3], (MLP_HIDDEN, MLP_OUT), F32) / np.sqrt(MLP_HIDDEN),
        'b2': jnp.zeros(MLP_OUT, F32)}
    return x, y, params


def mlp_states(sj, params):
    """The States of the MLP step, in the explicit state's structure:
    ``{'params': {name: ParamState}, 'bn': {'mean', 'var': BatchState},
    'rng': RandomState, 'adam': {'m', 'v', 'count': State}}`` (m and v hold a
    dict like ``params``)."""
    zeros = {k: jnp.zeros_like(p) for k, p in params.items()}
    return {
        'params': {k: sj.ParamState(p, name=k) for k, p in params.items()},
        'bn': {'mean': sj.BatchState(jnp.zeros(MLP_HIDDEN, F32), name='bn_mean'),
               'var': sj.BatchState(jnp.ones(MLP_HIDDEN, F32), name='bn_var')},
        'rng': sj.RandomState(0, name='dropout'),
        'adam': {'m': sj.State(zeros, name='adam_m'), 'v': sj.State(zeros, name='adam_v'),
                 'count': sj.State(jnp.zeros((), jnp.int32), name='adam_count')}}


def _forward(p, x, y, key, bn_mean, bn_var, momentum):
    """Loss of one batch and the new BatchNorm running statistics."""
    h = x @ p['w1'] + p['b1']
    mean, var = jnp.mean(h, 0), jnp.var(h, 0)
    h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * p['gamma'] + p['beta']
    h = jax.nn.relu(h)
    h = jnp.where(jax.random.bernoulli(key, KEEP, h.shape), h / KEEP, 0.0)
    logits = h @ p['w2'] + p['b2']
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)
    new_bn = (momentum * bn_mean + (1 - momentum) * mean,
              momentum * bn_var + (1 - momentum) * var)
    return jnp.mean(nll), new_bn


def _adam(p, g, m, v, count):
    """One adam update: new (params, m, v, count)."""
    count = count + 1
    m = jax.tree_util.tree_map(lambda m, g: B1 * m + (1 - B1) * g, m, g)
    v = jax.tree_util.tree_map(lambda v, g: B2 * v + (1 - B2) * g * g, v, g)
    c = count.astype(F32)
    p = jax.tree_util.tree_map(
        lambda p, m, v: p - LR * (m / (1 - B1 ** c)) / (jnp.sqrt(v / (1 - B2 ** c)) + EPS),
        p, m, v)
    return p, m, v, count


def mlp_step(st, momentum: float = 0.9, runs=None):
    """f(x, y) over the States ``st`` (:func:`mlp_states`): one training step,
    returning the loss and the parameters' gradients."""
    runs = new_runs() if runs is None else runs
    ps, bn, rng, adam = st['params'], st['bn'], st['rng'], st['adam']

    def loss(params, x, y):
        runs['body'] += 1
        for k, s in ps.items():
            s.value = params[k]
        value, (bn['mean'].value, bn['var'].value) = _forward(
            {k: s.value for k, s in ps.items()}, x, y, rng.split_key(),
            bn['mean'].value, bn['var'].value, momentum)
        return value

    def step(x, y):
        runs['step'] += 1
        value, g = jax.value_and_grad(loss)({k: s.value for k, s in ps.items()}, x, y)
        p, adam['m'].value, adam['v'].value, adam['count'].value = _adam(
            {k: s.value for k, s in ps.items()}, g, adam['m'].value, adam['v'].value,
            adam['count'].value)
        for k, s in ps.items():
            s.value = p[k]
        return value, g
    return step


def mlp_pure(momentum: float = 0.9, runs=None):
    """pure(state, x, y) -> (new_state, out): :func:`mlp_step` with the
    state (:func:`mlp_states`' structure, values) threaded by hand."""
    runs = new_runs() if runs is None else runs

    def loss(params, x, y, key, bn):
        runs['body'] += 1
        return _forward(params, x, y, key, bn['mean'], bn['var'], momentum)

    def pure(state, x, y):
        runs['step'] += 1
        key, sub = jax.random.split(state['rng'])     # RandomState.split_key()
        (value, (mean, var)), g = jax.value_and_grad(loss, has_aux=True)(
            state['params'], x, y, sub, state['bn'])
        a = state['adam']
        p, m, v, count = _adam(state['params'], g, a['m'], a['v'], a['count'])
        return {'params': p, 'bn': {'mean': mean, 'var': var}, 'rng': key,
                'adam': {'m': m, 'v': v, 'count': count}}, (value, g)
    return pure
