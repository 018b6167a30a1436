"""The one door to torch's private names (tfdoctor/usercode/torch_compat.py): each of its functions works on
the installed torch and gives the kind of object its callers expect, no other tfdoctor module names a
private torch name, and importing the door does not import torch."""

import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from helpers import ROOT
from tfdoctor.usercode import torch_compat as compat

# The layout tool's pattern (../shared/tools/layout.py PRIVATE_TORCH): torch.x._y, from torch._x, import torch._x
PRIVATE_TORCH = re.compile(r"torch(\.[A-Za-z0-9_]+)*\._[A-Za-z]|from torch(\.[A-Za-z0-9_]+)*\._"
                           r"|import torch(\.[A-Za-z0-9_]+)*\._")
COMPAT = ROOT / "tfdoctor" / "usercode" / "torch_compat.py"


def test_no_module_but_the_compat_one_names_a_private_torch_name():
    naming = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tfdoctor").rglob("*.py")
                    if path != COMPAT and PRIVATE_TORCH.search(path.read_text()))
    assert naming == []
    assert PRIVATE_TORCH.search(COMPAT.read_text())  # the pattern still finds what it is meant to


@pytest.mark.e2e
def test_importing_the_compat_module_does_not_import_torch():
    code = "import sys, tfdoctor.usercode.torch_compat; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_installed_torch_is_at_least_the_floor_pyproject_promises():
    assert compat.torch_version() >= compat.TORCH_FLOOR
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert floor and (int(floor[1]), int(floor[2])) == compat.TORCH_FLOOR


def test_a_missing_feature_is_an_import_error_that_names_the_version():
    error = compat.MissingTorchFeature("FSDPMemTracker", "2.5")
    assert isinstance(error, ImportError)
    assert "torch 2.5 or newer" in str(error) and compat.torch_version_text() in str(error)


# -- modes and pytrees -----------------------------------------------------------------------------

def test_dispatch_mode_base_sees_aten_ops():
    class Ops(compat.dispatch_mode_base()):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        torch.ones(2) * 3
    assert "mul" in ops.seen


def test_outside_function_mode_turns_the_innermost_mode_off_and_nothing_else():
    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    x = torch.ones(3)
    with Count() as mode:
        with compat.outside_function_mode(mode):
            x + 1
        quiet = Count.calls
        x + 1
    assert quiet == 0 and Count.calls > 0
    with compat.outside_function_mode(object()):  # not the current mode: a no-op context
        x + 1


def test_is_compiling_answers_false_outside_compile():
    is_compiling = compat.is_compiling_function()
    assert callable(is_compiling) and is_compiling() is False


def test_pytree_round_trip_and_leaves():
    tree = ({"a": torch.ones(1), "b": [1, 2]}, (3,))
    leaves, spec = compat.tree_flatten(tree)
    assert len(leaves) == 4 and compat.tree_leaves(tree)[1:] == [1, 2, 3]
    rebuilt = compat.tree_unflatten([0, 1, 2, 3], spec)
    assert rebuilt == ({"a": 0, "b": [1, 2]}, (3,))


# -- autograd graph and storages -------------------------------------------------------------------

def test_backward_runs_under_the_current_autograd_node_and_nodes_are_numbered_in_order():
    seen = []

    class Nodes(compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            node = compat.current_autograd_node()
            if node is not None:
                seen.append(node.name())
            return func(*args, **(kwargs or {}))

    assert compat.current_autograd_node() is None  # not in backward
    w = torch.ones(3, requires_grad=True)
    first = w * 2
    second = first.sum()
    assert compat.autograd_node_number(first.grad_fn) < compat.autograd_node_number(second.grad_fn)
    with Nodes():
        second.backward()
    assert "SumBackward0" in seen and "MulBackward0" in seen


def test_storage_ids_name_storages_not_tensors():
    base = torch.zeros(4)
    assert compat.tensor_storage_id(base[1:]) == compat.tensor_storage_id(base)
    assert compat.storage_id(base.untyped_storage()) == compat.tensor_storage_id(base)
    assert compat.tensor_storage_id(torch.zeros(4)) != compat.tensor_storage_id(base)


# -- fake tensors ----------------------------------------------------------------------------------

def test_fake_tensor_mode_makes_fake_tensors_that_are_recognised():
    mode = compat.fake_tensor_mode(allow_non_fake_inputs=True)
    fake = mode.from_tensor(torch.ones(2, 3))
    assert compat.is_fake_tensor(fake) and fake.shape == (2, 3)
    assert not compat.is_fake_tensor(torch.ones(2))
    with mode:
        made = torch.empty(1000, 1000)
    assert compat.is_fake_tensor(made)


def test_fake_tensor_errors_quiet_restores_the_logger_level():
    import logging

    logger = logging.getLogger(compat.FAKE_TENSOR_LOGGER)
    before = logger.level
    with compat.fake_tensor_errors_quiet():
        assert logger.level == logging.CRITICAL
    assert logger.level == before


# -- foreach kernels -------------------------------------------------------------------------------

def test_foreach_norms_are_the_norms():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 4.0]])]
    assert [float(n) for n in compat.foreach_norms(tensors)] == pytest.approx([5.0, 5.0])


def _adam_state(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    return params, grads, [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]


def test_adam_update_with_and_without_foreach_kernels_agree():
    fused, single = _adam_state(0), _adam_state(0)
    for step in (1, 2, 3):
        compat.adam_update(*fused, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, step=step)
        compat.adam_update_per_tensor(*single, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, step=step)
    for a, b in zip(fused[0] + fused[2] + fused[3], single[0] + single[2] + single[3]):
        torch.testing.assert_close(a, b)


def test_adam_first_step_moves_each_weight_by_lr_against_its_gradient_sign():
    params, grads, means, squares = _adam_state(1)
    before = [p.clone() for p in params]
    compat.adam_update(params, grads, means, squares, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, step=1)
    for p, p0, g in zip(params, before, grads):  # bias-corrected m / sqrt(v) = g / |g| at step 1
        torch.testing.assert_close(p, p0 - 1e-2 * torch.sign(g), rtol=0, atol=1e-6)


# -- data loading, mixed precision, schedulers, compile --------------------------------------------

def test_dataloader_iterators_share_the_base_and_keep_their_settings():
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    iterator = iter(loader)
    base = compat.dataloader_iterator_base()
    assert isinstance(base, type) and isinstance(iterator, base) and "__next__" in base.__dict__
    assert compat.dataloader_iterator_setting(iterator, "num_workers") == 0
    assert compat.dataloader_iterator_setting(iterator, "no_such_setting", "default") == "default"
    assert compat.index_sampler(loader) is not None and compat.index_sampler(iterator) is not None


def test_grad_scaler_facts():
    scaler = torch.amp.GradScaler("cpu")
    assert compat.scaler_enabled(scaler) and compat.scaler_device(scaler) == "cpu"
    assert compat.scaler_init_scale(scaler) == 2.0 ** 16
    assert compat.scaler_scale_tensor(scaler) is None  # made at the first scale()
    scaler.scale(torch.ones((), requires_grad=True))
    assert isinstance(compat.scaler_scale_tensor(scaler), torch.Tensor)
    assert not compat.scaler_enabled(torch.amp.GradScaler("cpu", enabled=False))


def test_autocast_regions_say_whether_they_cast():
    assert compat.autocast_enabled(torch.autocast("cpu"))
    assert not compat.autocast_enabled(torch.autocast("cpu", enabled=False))


def test_scheduler_facts():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    during_init = []
    original = torch.optim.lr_scheduler.LinearLR.step

    class Watched(torch.optim.lr_scheduler.LinearLR):
        def step(self, *args, **kwargs):
            during_init.append(compat.scheduler_is_initial(self))
            return original(self, *args, **kwargs)

    first = Watched(optimizer, total_iters=2)
    assert during_init == [True]  # the step __init__ makes
    optimizer.step()
    first.step()
    assert during_init == [True, False]
    second = torch.optim.lr_scheduler.ConstantLR(optimizer, total_iters=1)
    chained = torch.optim.lr_scheduler.SequentialLR(optimizer, [first, second], milestones=[1])
    assert compat.chained_schedulers(chained) == (first, second)
    assert compat.chained_schedulers(first) == ()


def test_compiled_inner_is_the_wrapped_module():
    model = nn.Linear(2, 2)
    assert compat.compiled_inner(torch.compile(model)) is model
    assert compat.compiled_inner(model) is None


# -- attention kernels -----------------------------------------------------------------------------

def test_the_attention_op_names_are_aten_ops():
    for name in (*compat.SDPA_FUSED, compat.SDPA_MATH):
        assert name.startswith(compat.SDPA_OP_PREFIX) and hasattr(torch.ops.aten, name), name


def test_math_attention_is_scaled_dot_product_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(compat.sdpa_math(q, k, v, None, 0.0, True, None, False),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))
    k2, v2 = k[:, :2], v[:, :2]  # two key/value heads for four query heads
    torch.testing.assert_close(compat.sdpa_math(q, k2, v2, None, 0.0, False, 0.5, True),
                               F.scaled_dot_product_attention(q, k2, v2, scale=0.5, enable_gqa=True))


def test_fused_cuda_attention_kernels_give_the_query_shape_on_fake_tensors():
    mode = compat.fake_tensor_mode(allow_non_fake_inputs=True)
    with mode:
        q, k, v = (torch.empty(2, 4, 16, 64, dtype=torch.float16) for _ in range(3))
        flash = compat.sdpa_flash(q, k, v, 0.0, True, 1 / math.sqrt(64))
        efficient = compat.sdpa_efficient(q, k, v, None, False, 0.0, True, None)
    assert flash.shape == efficient.shape == q.shape


# -- FSDP2 and DTensor -----------------------------------------------------------------------------

def test_fsdp2_names_resolve_and_a_plain_model_has_no_fsdp2_params():
    assert isinstance(compat.fsdp2_module_class(), type) and isinstance(compat.dtensor_class(), type)
    assert callable(compat.fully_shard_function()) and isinstance(compat.fsdp2_memory_tracker_class(), type)
    model = nn.Sequential(nn.Linear(2, 2))
    assert compat.fsdp2_params(model) == []
    plain = torch.ones(2)
    assert compat.local_tensor(plain) is plain
    assert compat.fsdp2_param_tensors(object()) == ([], [])


def test_the_hook_tables_a_plain_copy_empties_are_modules_attributes():
    attributes = vars(nn.Linear(2, 2))
    assert all(name in attributes for name in compat.MODULE_HOOK_TABLES)
    assert compat.is_fsdp2_bookkeeping("__composable_api_state_key_1234")
    assert compat.is_fsdp2_bookkeeping("_is_fsdp_managed_module") and not compat.is_fsdp2_bookkeeping("weight")
