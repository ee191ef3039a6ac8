"""gdr_dispatch.integrations.transformers: HF Qwen3-Next / Qwen3.5 trained with and without the hook.

Unhooked, the models run HF's torch reference (the function its fla-or-torch decorator wraps):
where fla-core imports, the decorated name binds fla's Triton op, which fails on a CPU machine.
The training comparison runs in fp64, HF's reference included (`in_fp64`): in fp32, AdamW's first
steps turn rounding-level gradient differences into ~1e-3 ones (HF's reference against itself with
chunk_size 32 instead of 64 differs by that much after three steps).
"""

import copy
import inspect
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

import gdr_dispatch  # noqa: E402
from gdr_dispatch.integrations import transformers as gdr_hf  # noqa: E402

try:
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
except ImportError:  # an older transformers: Qwen3-Next only
    qwen3_5 = None

B, T = 2, 80  # two chunks, the second partial
VOCAB = 97


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch):
    """HF's torch reference under every known modeling module's names, and the hook off after."""
    import importlib

    for name in gdr_hf.MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(mod, fn, plain_function(getattr(mod, fn)))
    yield
    gdr_hf.disable()  # before monkeypatch puts the decorated functions back


def plain_function(fn):
    """The Python function under HF's decorators: its `__wrapped__` chain, and where `kernels` is
    installed (transformers from 5.25 require it) the function its function-module (a `Func`
    `nn.Module` instance whose forward calls it) closes over."""
    if isinstance(fn, torch.nn.Module):
        cells = type(fn).forward.__closure__ or ()
        fn = next(c.cell_contents for c in cells if inspect.isfunction(c.cell_contents))
    return inspect.unwrap(fn)


def in_fp64(fn):
    """HF's torch reference with its fp32 upcast made fp64: it casts with `torch.float32` read
    from its module's globals, so a copy of the function sees a `torch` whose float32 is fp64."""

    class Fp64Torch(types.ModuleType):
        float32 = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    glob = dict(fn.__globals__, torch=Fp64Torch("torch"))
    out = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def linear_attn_config(**extra):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=32, max_position_embeddings=256,
                initializer_range=0.1, **extra)


def qwen3_next_model():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # value heads 4 over key heads 2: q and k reach the op at 2 heads (this transformers repeats
    # them inside its reference, which the hook replaces)
    cfg = Qwen3NextConfig(**linear_attn_config(linear_num_key_heads=2, linear_num_value_heads=4,
                                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=32, mlp_only_layers=[0, 2]))
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).float()


def qwen3_5_model():
    if qwen3_5 is None:
        pytest.skip("this transformers has no Qwen3.5")
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    # key heads == value heads: q, k and v reach the op as strided views of one projection
    cfg = Qwen3_5TextConfig(**linear_attn_config(linear_num_key_heads=2, linear_num_value_heads=2))
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(cfg).float()


MODELS = {"qwen3_next": qwen3_next_model, "qwen3_5": qwen3_5_model}


def perturb_gates(model):
    """A freshly built model has constant dt_bias and norm gains: spread them, so that no
    gradient is degenerate."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "norm.weight")) or "layernorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def train(model, ids, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads


def record_op_calls(monkeypatch):
    """Wrap the op the hook calls; return the list each call appends its inputs' layout to."""
    seen, op = [], gdr_dispatch.chunk_gated_delta_rule

    def recording(q, k, v, g, beta, **kw):
        seen.append({name: (x.dtype, tuple(x.shape), x.stride(), x.is_contiguous())
                     for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))}
                    | {"initial_state": None if kw.get("initial_state") is None else kw["initial_state"].dtype})
        return op(q, k, v, g, beta, **kw)

    monkeypatch.setattr(gdr_dispatch, "chunk_gated_delta_rule", recording)
    return seen


@pytest.mark.parametrize("arch", list(MODELS))
def test_training_matches_hf_torch_reference(arch, monkeypatch):
    ref = MODELS[arch]()
    ref.config._experts_implementation = "eager"  # torch's grouped_mm takes no fp64
    ref = ref.double()
    perturb_gates(ref)
    for mod in (qwen3_next, qwen3_5):
        if mod is not None:
            monkeypatch.setattr(mod, gdr_hf.FUNC_NAME, in_fp64(getattr(mod, gdr_hf.FUNC_NAME)))
    hooked = copy.deepcopy(ref)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))

    ref_losses, ref_grads = train(ref, ids)
    seen = record_op_calls(monkeypatch)
    assert gdr_hf.enable(hooked), "enable(model) patched nothing"
    losses, grads = train(hooked, ids)

    assert len(seen) == 2 * 3  # two linear-attention layers, three forwards (the backward calls no forward)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-10, atol=0)
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.keys() == want.keys()
        for name in want:
            err = ((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-300)).item()
            assert err < 1e-8, f"step {step}: {name}: relative gradient error {err:.2e}"
    # what HF hands the op, passed on as it is: q/k/v of [B, T, H, D], g in fp64 here (fp32 in a
    # bf16/fp32 model: HF builds it from `a.float()`)
    call = seen[0]
    assert call["g"][0] == torch.float64 and call["v"][1][:2] == (B, T)
    assert not call["v"][3], "v reached the op contiguous: HF's strided view was copied"
    if arch == "qwen3_5":  # no head repeat: q and k are views too (the l2norm keeps their layout)
        assert not call["q"][3] and not call["k"][3], call
    else:  # grouped: q and k at the key heads, v at the value heads
        assert call["q"][1][2] == call["k"][1][2] == 2 and call["v"][1][2] == 4, call


def test_cached_prefill_and_continuation_match(monkeypatch):
    """A second multi-token forward with a cache runs the chunk call with `initial_state` (the
    cached recurrent state) and `output_final_state=True`; the decode step stays HF's."""
    ref = qwen3_next_model().eval()
    perturb_gates(ref)
    hooked = copy.deepcopy(ref)
    ids = torch.randint(0, VOCAB, (B, 50), generator=torch.Generator().manual_seed(3))

    def run(model):
        with torch.no_grad():
            out = model(input_ids=ids[:, :30], use_cache=True)
            cache = out.past_key_values
            out2 = model(input_ids=ids[:, 30:49], past_key_values=cache, use_cache=True)
            out3 = model(input_ids=ids[:, 49:], past_key_values=out2.past_key_values, use_cache=True)
        return out.logits, out2.logits, out3.logits

    want = run(ref)
    seen = record_op_calls(monkeypatch)
    with gdr_hf.use_gdr_dispatch(hooked):
        got = run(hooked)
    assert [c["initial_state"] for c in seen] == [None, None, torch.float32, torch.float32]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_enable_disable_restore_exactly():
    mod = qwen3_next
    original = mod.torch_chunk_gated_delta_rule  # the torch reference (fixture)
    model = qwen3_next_model()

    assert gdr_hf.enable(model) == [mod.__name__]
    assert mod.torch_chunk_gated_delta_rule is gdr_hf.hf_chunk_gated_delta_rule
    assert gdr_hf.enable(model) == [] and gdr_hf.enable() == [m for m in gdr_hf.MODULES
                                                              if m != mod.__name__ and _importable(m)]
    assert gdr_hf.disable() and mod.torch_chunk_gated_delta_rule is original
    assert not gdr_hf.is_enabled(mod.__name__) and gdr_hf.disable() == []

    # a block undoes only what it enabled
    gdr_hf.enable(model)
    with gdr_hf.use_gdr_dispatch():
        pass
    assert gdr_hf.is_enabled(mod.__name__)
    gdr_hf.disable()
    with gdr_hf.use_gdr_dispatch(model):
        assert gdr_hf.is_enabled(mod.__name__)
    assert mod.torch_chunk_gated_delta_rule is original

    with pytest.raises(ValueError, match="no Gated DeltaNet layer"):
        gdr_hf.enable(torch.nn.Linear(2, 2))


def test_layer_holding_its_function_is_patched_on_the_instance():
    """transformers 4.x's layers bound `self.chunk_gated_delta_rule` in `__init__`."""

    class OldStyleGatedDeltaNet(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.chunk_gated_delta_rule = fn

    reference = qwen3_next.torch_chunk_gated_delta_rule
    layers = torch.nn.Sequential(OldStyleGatedDeltaNet(reference), OldStyleGatedDeltaNet(reference))
    keys = gdr_hf.enable(layers)
    assert len(keys) == 2 and not gdr_hf.is_enabled(qwen3_next.__name__)
    assert all(m.chunk_gated_delta_rule is gdr_hf.hf_chunk_gated_delta_rule for m in layers)
    assert gdr_hf.enable(layers) == []
    assert gdr_hf.disable(keys) == keys
    assert all(m.chunk_gated_delta_rule is reference for m in layers)


def _importable(name):
    import importlib

    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def _gdr_inputs(seed=0, B=2, T=70, H=2, K=16, V=32, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, h0


def test_adapter_matches_reference_and_names_bad_keywords(monkeypatch):
    hf_ref = qwen3_next.torch_chunk_gated_delta_rule  # the torch reference (fixture)
    q, k, v, g, beta, h0 = _gdr_inputs()
    want = hf_ref(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    # HF's forward keywords ride along and are dropped, as HF's wrapper drops them
    got = gdr_hf.hf_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=None, position_ids=None,
                                           max_length_q=None, output_attentions=False, cp_context=None)
    assert got[0].dtype == q.dtype and got[1].dtype == torch.float32
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)

    # cu_seqlens honoured (HF's reference ignores it): each packed sequence on its own
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    packed = [x.reshape(1, -1, *x.shape[2:])[:, :70] for x in (q, k, v, g, beta)]
    o, ht = gdr_hf.hf_chunk_gated_delta_rule(*packed, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    for i, (s, e) in enumerate(((0, 30), (30, 70))):
        o_i, h_i = hf_ref(*(x[:, s:e] for x in packed), initial_state=h0[i:i + 1], output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, s:e], o_i, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht[i:i + 1], h_i, rtol=1e-5, atol=1e-5)

    # a bf16 gate and state are taken (the op keeps the decay in fp32)
    o16, _ = gdr_hf.hf_chunk_gated_delta_rule(q, k, v, g.bfloat16(), beta, initial_state=h0.bfloat16(),
                                              use_qk_l2norm_in_kernel=True)
    assert o16.dtype == torch.float32
    o16_want, _ = hf_ref(q, k, v, g=g.bfloat16().float(), beta=beta, initial_state=h0.bfloat16().float(),
                         use_qk_l2norm_in_kernel=True)  # (unnormalised keys leave both ~5e-3 apart in fp32)
    torch.testing.assert_close(o16, o16_want, rtol=1e-5, atol=1e-5)

    with pytest.raises(TypeError, match="head_first=True"):
        gdr_hf.hf_chunk_gated_delta_rule(q, k, v, g, beta, head_first=True)
    with pytest.raises(TypeError, match="cp_context="):
        gdr_hf.hf_chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object())
    # a keyword of fla's op that we do not know is refused; anything else is HF's plumbing
    monkeypatch.setattr(gdr_hf, "_fla_keywords", frozenset({"frobnicate"}))
    with pytest.raises(TypeError, match="frobnicate=1"):
        gdr_hf.hf_chunk_gated_delta_rule(q, k, v, g, beta, frobnicate=1)
    gdr_hf.hf_chunk_gated_delta_rule(q, k, v, g, beta, use_cache=True, seq_idx=None)


def test_fp64_reference_is_fp64_and_matches_the_adapter():
    """`in_fp64` really lifts HF's reference to fp64 (its state comes back fp64, not fp32), and
    the adapter agrees with it to fp64 rounding."""
    q, k, v, g, beta, h0 = _gdr_inputs(dtype=torch.float64)
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, h_ref = in_fp64(qwen3_next.torch_chunk_gated_delta_rule)(q, k, v, **kw)
    o, h = gdr_hf.hf_chunk_gated_delta_rule(q, k, v, **kw)
    assert h_ref.dtype == h.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)


def test_l2norm_is_fla_and_hf_form():
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    y = gdr_hf.l2norm(x)
    xf = x.float()
    assert y.dtype == x.dtype
    torch.testing.assert_close(y, qwen3_next.l2norm(xf, dim=-1, eps=1e-6).bfloat16(), rtol=0, atol=0)
    z = torch.zeros(1, 4)  # F.normalize would give 0 here too, but through max(|x|, eps), not +eps
    torch.testing.assert_close(gdr_hf.l2norm(z), z)


def test_l2norm_takes_the_one_pass_kernels_only_for_eager_16_bit_cuda_tensors(monkeypatch):
    """The fused route (`_fused_l2norm`) is backends/kernels/l2norm.py's autograd function, and a
    CPU or fp64 tensor never reaches it (tests/test_l2norm.py checks the kernels on the CPU,
    tests/test_gpu.py the route on a GPU)."""
    from gdr_dispatch.backends.kernels import l2norm as kernels

    assert gdr_hf._fused_l2norm() is kernels.l2norm
    calls = []
    monkeypatch.setattr(gdr_hf, "_fused_l2norm", lambda: (lambda x, eps: calls.append(x) or x))
    x = torch.randn(2, 3, 2, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(gdr_hf.l2norm(x), (x.float() * torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True)
                                                                          + 1e-6)).bfloat16(), rtol=0, atol=0)
    gdr_hf.l2norm(x.double())
    assert calls == []


class LegacyGatedDeltaNet(torch.nn.Module):
    """transformers 4.x's layout: the layer holds its chunk function and repeats q and k to the
    value heads before calling it (HF's exact form)."""

    def __init__(self, fn, num_k_heads=2, num_v_heads=4):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.chunk_gated_delta_rule = fn

    def forward(self, query, key, value, g, beta, initial_state=None):
        if self.num_v_heads // self.num_k_heads > 1:
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        return self.chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("hg, h", [(2, 4), (1, 4), (2, 2)])
def test_a_layer_that_repeats_q_and_k_hands_the_op_the_key_heads(hg, h, monkeypatch):
    """Every r-th head of HF's repeat_interleave is an original: the op gets q and k at the key
    heads, and the gradients of the un-repeated q and k (and of v, g, beta, h0) equal those of
    HF's reference on the repeated ones, in float64."""
    gen = torch.Generator().manual_seed(4)
    Bt, Tt, K, V = 2, 70, 16, 8
    q, k = (torch.randn(Bt, Tt, hg, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(Bt, Tt, h, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(Bt, Tt, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(Bt, Tt, h, generator=gen, dtype=torch.float64)
    h0 = torch.randn(Bt, h, K, V, generator=gen, dtype=torch.float64)
    do, dht = torch.randn(Bt, Tt, h, V, generator=gen, dtype=torch.float64), torch.randn(h0.shape, generator=gen,
                                                                                          dtype=torch.float64)

    def grads(layer):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = layer(*leaves[:5], initial_state=leaves[5])
        ((o * do).sum() + (ht * dht).sum()).backward()
        return [o.detach(), ht.detach()] + [x.grad for x in leaves]

    want = grads(LegacyGatedDeltaNet(in_fp64(qwen3_next.torch_chunk_gated_delta_rule), hg, h))
    layer = LegacyGatedDeltaNet(qwen3_next.torch_chunk_gated_delta_rule, hg, h)
    assert gdr_hf.layer_repeats(layer) == h // hg
    seen = record_op_calls(monkeypatch)
    gdr_hf.enable(torch.nn.Sequential(layer))
    got = grads(layer)
    assert seen[0]["q"][1][2] == seen[0]["k"][1][2] == hg and seen[0]["v"][1][2] == h, seen[0]
    for name, x, y in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=name)


def test_a_layer_that_tiles_q_and_k_is_never_sliced():
    """A layer whose forward mentions HF's repeat_interleave only in a comment, and tiles the heads
    (`repeat`), is not read as repeating; an adapter handed tiled heads anyway (a factor read
    wrongly) finds out on its first call, says so, and gives every head to the op: the result is
    HF's reference on the tiled heads, not on every r-th one."""

    class Tiling(LegacyGatedDeltaNet):
        def forward(self, query, key, value, g, beta, initial_state=None):
            # query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            # key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            r = self.num_v_heads // self.num_k_heads
            query, key = query.repeat(1, 1, r, 1), key.repeat(1, 1, r, 1)
            return self.chunk_gated_delta_rule(query, key, value, g=g, beta=beta)

    assert gdr_hf.layer_repeats(Tiling(None, 2, 4)) == 1
    q, k, v, g, beta, _ = _gdr_inputs(H=2)
    q4, k4 = q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1)  # heads 0 1 0 1: every 2nd is not an original
    v4, g4, b4 = torch.cat([v, v], dim=2), torch.cat([g, g], dim=2), torch.cat([beta, beta], dim=2)
    with pytest.warns(UserWarning, match="not as repeat_interleave"):
        out = gdr_hf._adapter(2)(q4, k4, v4, g4, b4)[0]
    ref = gdr_hf.hf_chunk_gated_delta_rule(q4, k4, v4, g4, b4)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_repeats_are_read_from_the_layer_and_never_guessed():
    """This transformers' layers do not repeat (1); a module shared by layers that repeat
    differently slices nothing; q and k that come at the key heads are left as they are."""
    assert gdr_hf.layer_repeats(qwen3_next_model().model.layers[0].linear_attn) == 1

    class Lying(LegacyGatedDeltaNet):
        def forward(self, query, key, value, g, beta, initial_state=None):  # no repeat here
            return self.chunk_gated_delta_rule(query, key, value, g=g, beta=beta)

    assert gdr_hf.layer_repeats(Lying(None)) == 1

    # a modeling module whose layers read the module's name and repeat before the call
    mod = types.ModuleType("fake_modeling_gdn")
    mod.torch_chunk_gated_delta_rule = qwen3_next.torch_chunk_gated_delta_rule
    sys.modules[mod.__name__] = mod

    class ModuleGatedDeltaNet(LegacyGatedDeltaNet):
        def __init__(self, num_k_heads, num_v_heads):
            torch.nn.Module.__init__(self)
            self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads

    ModuleGatedDeltaNet.__module__ = mod.__name__
    try:
        assert gdr_hf._sites_of(torch.nn.Sequential(ModuleGatedDeltaNet(2, 4)))[0][3] == 2
        assert gdr_hf._sites_of(torch.nn.Sequential(ModuleGatedDeltaNet(2, 4), ModuleGatedDeltaNet(1, 4)))[0][3] == 1
        gdr_hf.enable(torch.nn.Sequential(ModuleGatedDeltaNet(2, 4)))
        assert gdr_hf._repeats_of(mod.torch_chunk_gated_delta_rule) == 2
        gdr_hf.enable(torch.nn.Sequential(ModuleGatedDeltaNet(1, 4)))  # another model, another repeat
        assert mod.torch_chunk_gated_delta_rule is gdr_hf.hf_chunk_gated_delta_rule
        gdr_hf.disable()
        assert mod.torch_chunk_gated_delta_rule is qwen3_next.torch_chunk_gated_delta_rule
    finally:
        del sys.modules[mod.__name__]
    q, k, v, g, beta, _ = _gdr_inputs(H=2)
    fn = gdr_hf._adapter(2)
    out = fn(q, k, torch.cat([v, v], dim=2), torch.cat([g, g], dim=2), torch.cat([beta, beta], dim=2))[0]
    ref = gdr_hf.hf_chunk_gated_delta_rule(q, k, torch.cat([v, v], dim=2), torch.cat([g, g], dim=2),
                                           torch.cat([beta, beta], dim=2))[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
