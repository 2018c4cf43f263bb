import jax
import jax.numpy as jnp

from jax_backend.compile_counter import CompileCounter


def test_counts_each_compile_and_no_cached_call():
    CompileCounter.install()
    CompileCounter.install()  # idempotent: one listener, one count per compile

    @jax.jit
    def double(x):
        return 2 * x

    three, other_three, four = jnp.ones(3), jnp.zeros(3), jnp.ones(4)  # eager ops compile too
    before, seconds = CompileCounter.count, CompileCounter.seconds
    double(three).block_until_ready()
    assert CompileCounter.count == before + 1 and CompileCounter.seconds > seconds
    double(other_three).block_until_ready()  # same shape: served by the jit cache
    assert CompileCounter.count == before + 1
    double(four).block_until_ready()  # a new shape compiles again
    assert CompileCounter.count == before + 2
