import numpy as np
import pytest

from meshagent.serving.sampling import Sampler, SamplingParams


def logits_for(probs: list[float], vocab: int = 1000) -> np.ndarray:
    out = np.full(vocab, -30.0, dtype=np.float32)
    out[: len(probs)] = np.log(np.asarray(probs, dtype=np.float32))
    return out


def test_greedy_takes_the_argmax():
    logits = np.random.default_rng(0).normal(size=5000).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.0))
    assert s.sample(logits) == int(np.argmax(logits))


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = np.random.default_rng(1).normal(size=5000).astype(np.float32)

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s.sample(logits) for _ in range(20)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_sampling_follows_the_distribution():
    probs = [0.6, 0.3, 0.1]
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = np.bincount([s.sample(logits_for(probs)) for _ in range(4000)], minlength=3)[:3]
    assert np.allclose(draws / draws.sum(), probs, atol=0.03)


def test_top_p_keeps_only_the_nucleus():
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.85, seed=5))
    draws = {s.sample(logits_for([0.6, 0.3, 0.1])) for _ in range(500)}
    assert draws == {0, 1}


def test_top_p_falls_back_to_the_full_vocabulary_for_flat_distributions():
    vocab = 2000
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=9))
    flat = np.zeros(vocab, dtype=np.float32)
    draws = {s.sample(flat) for _ in range(300)}
    # Half the mass of a flat distribution is 1000 tokens: far more than a short list.
    assert len(draws) > 200
    assert max(draws) < vocab


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalties_discourage_repeats(penalty):
    logits = logits_for([0.5, 0.45, 0.05])
    s = Sampler(SamplingParams(temperature=0.0, **{penalty: 2.0}))
    assert s.sample(logits) == 0
    assert s.sample(logits) == 1  # token 0 is now penalised below token 1
