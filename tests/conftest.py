import pytest
import torch

from posbench.encodings import REGISTRY, ModelDims

torch.set_num_threads(2)


def make_encoding(name: str, causal: bool = True, n_heads: int = 2, d_model: int = 16, max_positions: int = 64,
                  **params):
    dims = ModelDims(d_model=d_model, n_heads=n_heads, n_layers=2, max_positions=max_positions,
                     train_positions=max_positions, causal=causal, vocab_size=11)
    return REGISTRY[name](dims, **params)


@pytest.fixture(params=sorted(REGISTRY))
def encoding_name(request):
    return request.param
