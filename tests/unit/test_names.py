"""Parameter names as a run knows them (`storage.names`): the same under every wrapper."""

from __future__ import annotations

import pytest
import torch

from diloco.storage.names import model_names, plain_name, run_parameters


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)


BARE = ["body.weight", "body.bias"]


def test_wrappers_are_taken_off_the_names():
    net = Net()
    for wrapped in (torch.nn.DataParallel(net), torch.compile(net, backend="eager"),
                    torch.compile(torch.nn.DataParallel(net), backend="eager")):
        params = run_parameters(wrapped)
        assert list(params) == BARE
        assert params["body.weight"] is net.body.weight  # the same tensors, written in place
    assert model_names(torch.nn.DataParallel(net)) == {n: f"module.{n}" for n in BARE}


def test_a_child_called_module_keeps_its_name():
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = Net()

    assert list(run_parameters(Holder())) == [f"module.{n}" for n in BARE]


def test_wrapper_segments_inside_the_model_are_dropped():
    assert plain_name("_orig_mod.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.weight") == \
        "layers.0.mlp.weight"


def test_names_that_collide_without_their_wrappers_are_refused():
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
            self._checkpoint_wrapped_module = torch.nn.Module()
            self._checkpoint_wrapped_module.a = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="both 'a.weight'"):
        run_parameters(Twice())
