"""``benchmarks/profile.py``: a real jax.profiler trace of a jitted program, summed per part of the model."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import profile


class TwoParts(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(512, name="mlp")(x))
        return nn.Dense(256, name="lm_head")(h)


def test_a_trace_is_summed_per_part_and_kind():
    model = TwoParts()
    x = jnp.ones((256, 512))
    params = model.init(jax.random.key(0), x)
    forward = jax.jit(model.apply)
    forward(params, x).block_until_ready()
    hlo = forward.lower(params, x).compile().as_text()

    rows = profile.profile(lambda: [forward(params, x).block_until_ready() for _ in range(3)], hlo, calls=3)

    by_key = {(r.part, r.kind): r for r in rows}
    assert by_key[("MLP", "matmul")].op_ms > 0, rows
    assert by_key[("LM head", "matmul")].op_ms > 0, rows
    assert by_key[("MLP", "matmul")].ops == 1  # one matmul per call, three calls traced
    assert [r.op_ms for r in rows] == sorted((r.op_ms for r in rows), reverse=True)
    table = profile.format_rows(rows, wall_ms=1.0, threads=2)
    assert "LM head" in table and "against 1.00 ms of wall time on 2 threads" in table


def test_instructions_are_named_by_their_scope_or_else_by_their_shape():
    hlo = "\n".join(
        [
            '  %fusion.3 = f32[8,512]{1,0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/layer_0/attn/mul"}',
            '  ROOT %dot.7 = f32[8,2048]{1,0} dot(%a, %b), metadata={op_name="jit(f)/layer_0/mlp/fc_in/dot_general"}',
            "  %dot.9 = f32[1,512]{1,0} dot(%a, %b), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
            '  %ynn_fusion.2 = f32[8,8192]{1,0} fusion(%a), kind=kCustom, metadata={op_name="jit(f)/lm_head/dot_general"}',
            '  %reduce.1 = f32[8]{0} reduce(%x), metadata={op_name="jit(f)/_emit/argmax"}',
            '  %dot.2 = f32[8,8,1,9]{3,2,1,0} dot(%q, %k), metadata={op_name="jit(f)/layer_1/attn/bqhd,bhdk->bhqk/dot_general"}',
            '  %dot.3 = f32[8,1,512]{2,1,0} dot(%x, %w), metadata={op_name="jit(f)/transpose(jvp(f))/attn/btd,dhk->bthk/dot_general"}',
            '  %add.5 = f32[8,512]{1,0} add(%h, %a), metadata={op_name="jit(f)/while/body/layers/add"}',
            '  %sqrt.1 = f32[512]{0} sqrt(%v), metadata={op_name="jit(train_step)/optimizer/sqrt"}',
        ]
    )
    assert profile._instructions(hlo) == {
        "fusion.3": (False, "attention"),
        "dot.7": (True, "MLP"),
        "dot.9": (True, "f32[1,512]"),
        "ynn_fusion.2": (True, "LM head"),
        "reduce.1": (False, "sampling"),
        "dot.2": (True, "attention"),
        "dot.3": (True, "attn q/k/v/out"),
        "add.5": (False, "layer stack"),
        "sqrt.1": (False, "optimiser"),
    }
