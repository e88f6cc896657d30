"""Tests for clip_model.py: numerical parity with open_clip, the loading paths, per-head
attention, the per-head decomposition, and what bad input gets.

    python -m pytest -q tests/test_clip_model.py
"""

import functools
import http.server
import os
import threading

import pytest
import torch
import torch.nn as nn

import clip_model
from conftest import TINY, assert_close, closed_port, perturb_

# ------------------------------------------------------------------------------------------
# Parity with open_clip's ViT-B/16 (the reference implementation), same random weights
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openclip_b16(tmp_path_factory):
    """open_clip's ViT-B-16-quickgelu with perturbed random weights, saved as an OpenAI-format
    state dict and loaded back through our `load(path)`."""
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    reference = open_clip.create_model("ViT-B-16-quickgelu", pretrained=None)
    perturb_(reference, scale=0.02).eval()
    path = tmp_path_factory.mktemp("b16") / "ViT-B-16-random.pt"
    torch.save(reference.state_dict(), path)
    ours, preprocess = clip_model.load(str(path))
    tokenizer = open_clip.get_tokenizer("ViT-B-16-quickgelu")
    return reference, ours, preprocess, tokenizer


def test_b16_image_and_text_features_and_logits_match_open_clip(openclip_b16):
    reference, ours, _, tokenizer = openclip_b16
    torch.manual_seed(1)
    images = torch.randn(3, 3, 224, 224)
    text = tokenizer(["a photo of a cat.", "a centered satellite photo of Sea or Lake.",
                      "zigzagged texture.", "an émoji 🙂 &amp; friends"])
    with torch.no_grad():
        assert_close(ours.encode_image(images), reference.encode_image(images), 1e-4, "encode_image")
        assert_close(ours.encode_text(text), reference.encode_text(text), 1e-4, "encode_text")
        logits_per_image, logits_per_text = ours(images, text)
        image_features, text_features, scale = reference(images, text)[:3]
        expected = scale * image_features @ text_features.t()
    assert_close(logits_per_image, expected, 1e-4, "logits_per_image")
    assert_close(logits_per_text, expected.t(), 1e-4, "logits_per_text")


def test_b16_architecture_is_inferred_from_the_state_dict(openclip_b16):
    _, ours, _, _ = openclip_b16
    visual = ours.visual
    assert (visual.input_resolution, visual.patch_size, visual.grid_size) == (224, 16, 14)
    assert (visual.transformer.layers, visual.transformer.heads, visual.transformer.width) == (12, 12, 768)
    assert (ours.transformer.layers, ours.transformer.heads, ours.transformer.width) == (12, 8, 512)
    assert ours.token_embedding.num_embeddings == 49408 and ours.context_length == 77
    assert visual.proj.shape == (768, 512)
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_b16_head_decomposition_sums_to_encode_image(openclip_b16):
    _, ours, _, _ = openclip_b16
    torch.manual_seed(2)
    images = torch.randn(2, 3, 224, 224)
    parts = clip_model.head_contributions(ours, images, num_layers=4)
    assert parts.heads.shape == (2, 4, 12, 512)
    assert parts.layers == (8, 9, 10, 11)
    with torch.no_grad():
        assert_close(parts.total(), ours.encode_image(images), 1e-4, "sum of contributions")


def test_preprocess_matches_open_clip(openclip_b16):
    open_clip = pytest.importorskip("open_clip")
    from PIL import Image

    _, _, preprocess, _ = openclip_b16
    _, _, reference_preprocess = open_clip.create_model_and_transforms("ViT-B-16-quickgelu", pretrained=None)
    generator = torch.Generator().manual_seed(3)
    for mode, size in (("RGB", (300, 200)), ("RGBA", (97, 151)), ("L", (224, 224))):
        pixels = torch.randint(0, 256, (size[1], size[0], len(mode)), generator=generator, dtype=torch.uint8)
        image = Image.fromarray(pixels.squeeze(-1).numpy(), mode=mode)
        ours, expected = preprocess(image), reference_preprocess(image)
        assert ours.shape == (3, 224, 224)
        assert_close(ours, expected, 1e-6, f"preprocess {mode} {size}")


# ------------------------------------------------------------------------------------------
# Per-head attention
# ------------------------------------------------------------------------------------------


def _attention_pair(width=64, heads=4, seed=0):
    torch.manual_seed(seed)
    ours = perturb_(clip_model.MultiHeadAttention(width, heads), scale=0.1, seed=seed)
    reference = nn.MultiheadAttention(width, heads, batch_first=True)
    reference.load_state_dict(ours.state_dict())  # same parameter names, by design
    return ours, reference


def test_attention_equals_nn_multiheadattention():
    ours, reference = _attention_pair()
    x = torch.randn(3, 10, 64)
    causal = clip_model.causal_mask(10)
    with torch.no_grad():
        for mask in (None, causal):
            expected = reference(x, x, x, attn_mask=mask, need_weights=False)[0]
            assert_close(ours(x, mask), expected, 1e-5, f"attention, mask={mask is not None}")
            out, details = ours(x, mask, return_details=True)
            assert_close(out, expected, 1e-5, "attention with details")
            _, reference_weights = reference(x, x, x, attn_mask=mask, average_attn_weights=False)
            assert_close(details.weights, reference_weights, 1e-5, "per-head attention weights")


def test_mask_on_one_head_changes_only_that_head():
    ours, _ = _attention_pair()
    x = torch.randn(2, 7, 64)
    H, N, h = 4, 7, 2
    mask = torch.zeros(H, N, N)
    mask[h, :, 3:] = float("-inf")  # head 2 may only look at tokens 0..2
    with torch.no_grad():
        _, free = ours(x, return_details=True)
        _, masked = ours(x, mask, return_details=True)
    for head in range(H):
        same = torch.equal(free.head_outputs[:, head], masked.head_outputs[:, head])
        assert same == (head != h), f"head {head}: changed={not same}, masked head is {h}"
    assert masked.weights[:, h, :, 3:].abs().max() == 0, "the masked head still attends to masked keys"


@pytest.mark.parametrize("shape", ["N,N", "H,N,N", "B,H,N,N"])
def test_fused_attention_equals_the_spelled_out_one_for_every_mask_shape(shape):
    ours, _ = _attention_pair()
    B, H, N = 2, 4, 6
    x = torch.randn(B, N, 64)
    sizes = {"N,N": (N, N), "H,N,N": (H, N, N), "B,H,N,N": (B, H, N, N)}[shape]
    mask = torch.where(torch.rand(sizes) < 0.3, float("-inf"), 0.0)
    mask[..., 0] = 0.0  # every query may see token 0: no row is all -inf
    with torch.no_grad():
        fused = ours(x, mask)
        spelled_out, _ = ours(x, mask, return_details=True)
    assert_close(fused, spelled_out, 1e-5, f"mask {shape}")


def test_the_explicit_kernel_never_calls_the_fused_one_and_gives_its_result(tiny_clip, monkeypatch):
    """set_attention(model, "explicit"): every layer computes the maths itself (a fused kernel
    that misbehaves on a GPU is then never called), to the fused kernel's result within rounding,
    gradients included; an unknown kernel is one line."""
    images = torch.randn(2, 3, TINY["image_resolution"], TINY["image_resolution"], requires_grad=True)
    fused = tiny_clip.encode_image(images)
    (fused_grad,) = torch.autograd.grad(fused.sum(), images)
    monkeypatch.setattr(clip_model.F, "scaled_dot_product_attention",
                        lambda *a, **k: pytest.fail("the fused kernel was called"))
    assert clip_model.set_attention(tiny_clip, "explicit") is tiny_clip
    assert {m.kernel for m in tiny_clip.modules() if isinstance(m, clip_model.MultiHeadAttention)} \
        == {"explicit"}
    explicit = tiny_clip.encode_image(images)
    (explicit_grad,) = torch.autograd.grad(explicit.sum(), images)
    assert_close(explicit, fused, 1e-5, "explicit against fused")
    assert_close(explicit_grad, fused_grad, 1e-5, "their gradients")
    with pytest.raises(clip_model.CLIPError, match="attention kernel 'flash': use one of sdpa, explicit"):
        clip_model.set_attention(tiny_clip, "flash")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layernorm_and_softmax_run_in_fp32_under_autocast_as_on_cuda(dtype):
    """CUDA's autocast runs LayerNorm and softmax in fp32; the CPU's keeps a half input in half.
    clip_model does both in fp32 itself, so a bf16 run on the CPU is a GPU's, op for op: the
    LayerNorm of a half input is fp32 and equals fp32's LayerNorm of the same numbers; in fp32 it
    is torch's own exactly; the explicit softmax is fp32 before it meets v."""
    ln = perturb_(clip_model.LayerNorm(16))
    x = torch.randn(4, 16)
    assert torch.equal(ln(x), torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias))
    with torch.autocast("cpu", dtype=dtype):
        out = ln(x.to(dtype))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.layer_norm(x.to(dtype).float(), (16,), ln.weight, ln.bias))
    attention = clip_model.MultiHeadAttention(16, 2)
    captured = {}
    real_softmax = torch.Tensor.softmax

    def softmax(self, *args, **kwargs):  # what dtype the softmax computes in
        captured["dtype"] = kwargs.get("dtype", self.dtype)
        return real_softmax(self, *args, **kwargs)
    with pytest.MonkeyPatch.context() as patch, torch.autocast("cpu", dtype=dtype):
        patch.setattr(torch.Tensor, "softmax", softmax)
        attention(torch.randn(2, 5, 16).to(dtype), return_details=True)
    assert captured["dtype"] == torch.float32


def test_attention_rejects_a_mask_of_the_wrong_shape():
    ours, _ = _attention_pair()
    with pytest.raises(clip_model.CLIPError, match=r"attn_mask has shape \(3, 6, 6\)"):
        ours(torch.randn(2, 6, 64), torch.zeros(3, 6, 6))


def test_attention_rejects_a_bool_mask():
    # Why the mask is checked on every call: a bool mask (nn.MultiheadAttention's True = blocked)
    # would otherwise run without an error, added as 0/1 or read as True = may attend.
    ours, _ = _attention_pair()
    with pytest.raises(clip_model.CLIPError, match="attn_mask must be an additive float mask"):
        ours(torch.randn(2, 6, 64), torch.ones(6, 6, dtype=torch.bool).triu(1))


# ------------------------------------------------------------------------------------------
# Loading: plain state dicts, TorchScript archives, downloads and the cache
# ------------------------------------------------------------------------------------------


def _tiny_inputs(tokens_per_text=5):
    torch.manual_seed(4)
    images = torch.randn(2, 3, TINY["image_resolution"], TINY["image_resolution"])
    text = torch.randint(1, TINY["vocab_size"] - 1, (3, TINY["context_length"]))
    text[:, tokens_per_text:] = 0
    text[:, tokens_per_text - 1] = TINY["vocab_size"] - 1  # end-of-text: the largest id
    return images, text


def test_plain_state_dict_loads_with_the_same_outputs(tiny_clip, tiny_checkpoint):
    loaded, _ = clip_model.load(tiny_checkpoint)
    images, text = _tiny_inputs()
    with torch.no_grad():
        assert torch.equal(loaded.encode_image(images), tiny_clip.encode_image(images))
        assert torch.equal(loaded.encode_text(text), tiny_clip.encode_text(text))


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_torchscript_archive_loads(tmp_path, tiny_clip):
    # OpenAI publishes traced TorchScript archives whose state dicts also carry integer entries
    # (input_resolution, context_length, vocab_size) next to the weights; reproduce both.
    images, text = _tiny_inputs()
    for key, value in (("input_resolution", 32), ("vocab_size", 600)):
        tiny_clip.register_buffer(key, torch.tensor(value))
    traced = torch.jit.trace(tiny_clip, (images, text), check_trace=False)
    path = tmp_path / "tiny_jit.pt"
    torch.jit.save(traced, str(path))
    assert "vocab_size" in torch.jit.load(str(path)).state_dict()
    loaded, preprocess = clip_model.load(str(path))
    with torch.no_grad():
        assert_close(loaded(images, text)[0], tiny_clip(images, text)[0], 1e-6, "TorchScript logits")
    assert preprocess.transforms[1].size == (32, 32)


def test_a_half_precision_checkpoint_is_cast_to_float32(tmp_path, tiny_clip):
    path = tmp_path / "tiny_fp16.pt"
    torch.save({k: v.half() for k, v in tiny_clip.state_dict().items()}, path)
    loaded, _ = clip_model.load(str(path))
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


def test_text_features_do_not_depend_on_padding_after_the_end_token(tiny_clip):
    # The causal mask makes a text cut after its end-of-text token exact (dear.py relies on it).
    _, text = _tiny_inputs(tokens_per_text=5)
    with torch.no_grad():
        assert_close(tiny_clip.encode_text(text[:, :5]), tiny_clip.encode_text(text), 1e-5, "cut text")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def loopback_server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/served (loopback only: no real network)."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_model_name_downloads_checks_sha256_and_is_cached(tmp_path, tiny_checkpoint, loopback_server,
                                                            monkeypatch, capsys):
    served, address = loopback_server
    data = open(tiny_checkpoint, "rb").read()
    sha = clip_model._sha256(tiny_checkpoint)
    monkeypatch.setitem(clip_model._MODELS, "Tiny/8", f"{address}/{sha}/tiny.pt")
    (served / sha).mkdir()
    (served / sha / "tiny.pt").write_bytes(data)
    cache = tmp_path / "cache"

    model, _ = clip_model.load("Tiny/8", download_root=str(cache))
    assert (cache / "tiny.pt").read_bytes() == data
    assert "downloading CLIP Tiny/8" in capsys.readouterr().err
    assert model.visual.input_resolution == 32

    (served / sha / "tiny.pt").unlink()  # the cache must be used from now on
    clip_model.load("Tiny/8", download_root=str(cache))
    assert capsys.readouterr().err == ""


def test_a_download_with_the_wrong_checksum_leaves_nothing_behind(tmp_path, loopback_server):
    served, address = loopback_server
    (served / "tiny.pt").write_bytes(b"not what the checksum promises")
    cache = tmp_path / "cache"
    with pytest.raises(clip_model.CLIPFileError, match="SHA-256") as error:
        clip_model.download(f"{address}/tiny.pt", "0" * 64, str(cache), what="CLIP Tiny/8")
    assert "\n" not in str(error.value)
    assert os.listdir(cache) == []


def test_no_network_gives_a_one_line_error_that_says_to_pass_a_path(tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}/{'0' * 64}/ViT-B-16.pt"
    monkeypatch.setitem(clip_model._MODELS, "ViT-B/16", url)
    with pytest.raises(clip_model.CLIPFileError) as error:
        clip_model.load("ViT-B/16", download_root=str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "ViT-B/16" in message and "local path" in message
    assert os.listdir(tmp_path) == []  # no partial download left


# ------------------------------------------------------------------------------------------
# Bad input: one line that names the file and the problem
# ------------------------------------------------------------------------------------------


def _load_error(path_or_name) -> str:
    with pytest.raises(clip_model.CLIPFileError) as error:
        clip_model.load(str(path_or_name))
    message = str(error.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are not weights\n")
    message = _load_error(path)
    assert str(path) in message and "cannot be read as a checkpoint" in message


def test_a_truncated_checkpoint_is_named(tmp_path, tiny_checkpoint):
    path = tmp_path / "truncated.pt"
    data = open(tiny_checkpoint, "rb").read()
    path.write_bytes(data[: len(data) // 2])
    message = _load_error(path)
    assert str(path) in message and "truncated" in message


def test_a_state_dict_with_missing_keys_is_named(tmp_path, tiny_clip):
    state_dict = tiny_clip.state_dict()
    del state_dict["visual.transformer.resblocks.1.mlp.c_fc.bias"]
    path = tmp_path / "missing.pt"
    torch.save(state_dict, path)
    message = _load_error(path)
    assert str(path) in message
    assert 'Missing key(s) in state_dict: "visual.transformer.resblocks.1.mlp.c_fc.bias"' in message
    state_dict = tiny_clip.state_dict()
    state_dict["ln_final.bias"] = torch.zeros(5)  # a tensor of the wrong shape: one line too
    torch.save(state_dict, path)
    assert "size mismatch for ln_final.bias" in _load_error(path)


def test_a_state_dict_that_is_not_clip_is_named(tmp_path):
    path = tmp_path / "resnet.pt"
    torch.save({"conv.weight": torch.zeros(3, 3)}, path)
    message = _load_error(path)
    assert str(path) in message and "not an OpenAI CLIP ViT state dict" in message


def test_a_resnet_clip_checkpoint_is_not_supported(tmp_path, tiny_clip):
    state_dict = tiny_clip.state_dict()
    state_dict["visual.layer1.0.conv1.weight"] = torch.zeros(1)
    path = tmp_path / "rn50.pt"
    torch.save(state_dict, path)
    message = _load_error(path)
    assert str(path) in message and "ResNet" in message


def test_an_unknown_model_name_lists_the_known_ones():
    message = _load_error("ViT-H/99")
    assert "ViT-H/99" in message and "ViT-B/16" in message and "path" in message


def test_a_width_that_does_not_split_into_heads_is_explained(tiny_checkpoint):
    with pytest.raises(clip_model.CLIPFileError, match="head_width=48"):
        clip_model.load(tiny_checkpoint, head_width=48)


# ------------------------------------------------------------------------------------------
# Per-head decomposition on the tiny model (every layer count)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_tiny_head_decomposition_sums_to_encode_image(tiny_clip, num_layers):
    images, _ = _tiny_inputs()
    parts = clip_model.head_contributions(tiny_clip, images, num_layers=num_layers)
    assert parts.heads.shape == (2, num_layers, 2, TINY["embed_dim"])
    assert parts.layers == tuple(range(3 - num_layers, 3))
    with torch.no_grad():
        assert_close(parts.total(), tiny_clip.encode_image(images), 1e-5, "sum of contributions")


def test_a_head_contribution_is_that_heads_own_output(tiny_clip):
    # Silencing head 0 of the last layer (its columns of W_o) must make its contribution
    # exactly zero and leave head 1's direction alone (head 1's size changes only through
    # the shared ln_post scale of the full residual).
    images, _ = _tiny_inputs()
    attn = tiny_clip.visual.transformer.resblocks[-1].attn
    with torch.no_grad():
        attn.out_proj.bias.zero_()  # no bias share, so a silent head contributes nothing
    parts = clip_model.head_contributions(tiny_clip, images, num_layers=1)
    with torch.no_grad():
        attn.out_proj.weight[:, 0:64] = 0.0
    silenced = clip_model.head_contributions(tiny_clip, images, num_layers=1)
    assert parts.heads[:, 0, 0].abs().max() > 0
    assert silenced.heads[:, 0, 0].abs().max() == 0
    cosine = torch.nn.functional.cosine_similarity(silenced.heads[:, 0, 1], parts.heads[:, 0, 1], dim=-1)
    assert_close(cosine, torch.ones_like(cosine), 1e-5, "head 1 direction")


# ------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------


def model_sized_bpe(path, vocab_size: int = 600) -> None:
    """A merges file whose vocabulary is exactly the tiny models' (600): "red" as one token,
    then filler merges of two letters (512 byte tokens + merges + 2 specials)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    fillers = [f"{a} {b}" for a in letters for b in letters if f"{a}{b}" != "re"]
    path.write_text("#version: 0.2\nr e\nre d</w>\n" + "".join(f"{m}\n" for m in fillers[:vocab_size - 516]))


def test_command_line_scores_an_image_and_reports_bad_weights_in_one_line(tmp_path, tiny_checkpoint, capsys):
    from PIL import Image

    bpe = tmp_path / "bpe.txt"
    model_sized_bpe(bpe)  # the model's vocabulary: another size is refused (SimpleTokenizer.check_fits)
    image = tmp_path / "red.png"
    Image.new("RGB", (40, 50), (200, 10, 10)).save(image)
    status = clip_model._main(["--weights", tiny_checkpoint, "--bpe", str(bpe), "--image", str(image),
                               "--texts", "a red thing", "a blue thing"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and len(lines) == 2
    shares = [float(line.split("%")[0]) for line in lines]
    assert abs(sum(shares) - 100) < 0.2 and lines[0].endswith("a red thing")

    status = clip_model._main(["--weights", str(tmp_path / "absent.pt"), "--bpe", str(bpe),
                               "--image", str(image), "--texts", "x"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "absent.pt" in err


# ------------------------------------------------------------------------------------------
# No silently wrong CLIP: head counts and activation (what no tensor shape tells)
# ------------------------------------------------------------------------------------------

# Heads of 32 channels in the vision tower, 16 in the text tower, GELU: a plain load with
# OpenAI's defaults (heads of 64, QuickGELU) would build another model from the same tensors.
ODD = dict(TINY, vision_heads=4, transformer_heads=8, activation="gelu")


@pytest.fixture
def odd_clip() -> clip_model.CLIP:
    torch.manual_seed(0)
    return perturb_(clip_model.CLIP(**ODD), scale=0.2).eval()


def _same_outputs(a: clip_model.CLIP, b: clip_model.CLIP) -> float:
    images, text = _tiny_inputs()
    with torch.no_grad():
        return max((a.encode_image(images) - b.encode_image(images)).abs().max().item(),
                   (a.encode_text(text) - b.encode_text(text)).abs().max().item())


def test_a_file_written_by_save_loads_right_with_no_arguments(tmp_path, odd_clip):
    path = str(tmp_path / "odd.pt")
    clip_model.save(odd_clip, path)
    loaded, _ = clip_model.load(path)
    assert (loaded.visual.transformer.heads, loaded.transformer.heads, loaded.activation) == (4, 8, "gelu")
    assert _same_outputs(loaded, odd_clip) == 0.0
    stored = torch.load(path, weights_only=True)  # OpenAI's keys, plus three plain entries
    assert (stored["vision_heads"], stored["text_heads"], stored["activation"]) == (4, 8, "gelu")
    # An argument that contradicts the file is refused, naming what the file says.
    with pytest.raises(clip_model.CLIPFileError, match="vision_heads=4"):
        clip_model.load(path, head_width=64)
    with pytest.raises(clip_model.CLIPFileError, match="activation='gelu'"):
        clip_model.load(path, activation="quick_gelu")
    assert clip_model.load(path, vision_heads=4, text_heads=8, activation="gelu")[0].activation == "gelu"


def test_a_foreign_state_dict_needs_its_heads_and_activation_as_arguments(tmp_path, odd_clip):
    path = str(tmp_path / "foreign.pt")
    torch.save(odd_clip.state_dict(), path)  # no entries: what other projects write
    plain, _ = clip_model.load(path)  # OpenAI's defaults: the README's "wrong without an error"
    assert _same_outputs(plain, odd_clip) > 1e-3
    told, _ = clip_model.load(path, vision_heads=4, text_heads=8, activation="gelu")
    assert _same_outputs(told, odd_clip) == 0.0
    # Each of the three matters on its own.
    for wrong in (dict(vision_heads=2, text_heads=8, activation="gelu"),
                  dict(vision_heads=4, text_heads=2, activation="gelu"),
                  dict(vision_heads=4, text_heads=8, activation="quick_gelu")):
        assert _same_outputs(clip_model.load(path, **wrong)[0], odd_clip) > 1e-3, wrong
    with pytest.raises(clip_model.CLIPFileError, match="activation='relu'"):
        clip_model.load(path, activation="relu")


def test_open_clip_gelu_vit_b16_matches_when_loaded_with_activation_gelu(tmp_path):
    """open_clip's plain ViT-B-16 (exact GELU, the architecture of LAION's weights)."""
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    reference = perturb_(open_clip.create_model("ViT-B-16", pretrained=None), scale=0.02).eval()
    path = tmp_path / "ViT-B-16-gelu.pt"
    torch.save(reference.state_dict(), path)
    ours, _ = clip_model.load(str(path), activation="gelu")
    quick, _ = clip_model.load(str(path))  # what a plain load gives: QuickGELU
    images = torch.randn(2, 3, 224, 224)
    text = open_clip.get_tokenizer("ViT-B-16")(["a photo of a cat.", "zigzagged texture."])
    with torch.no_grad():
        expected_image, expected_text = reference.encode_image(images), reference.encode_text(text)
        assert_close(ours.encode_image(images), expected_image, 1e-4, "encode_image, gelu")
        assert_close(ours.encode_text(text), expected_text, 1e-4, "encode_text, gelu")
        assert (quick.encode_image(images) - expected_image).abs().max() > 1e-3  # the activation matters


def test_load_accepts_openais_jit_false_and_refuses_jit_true(tiny_checkpoint):
    assert isinstance(clip_model.load(tiny_checkpoint, jit=False)[0], clip_model.CLIP)
    with pytest.raises(clip_model.CLIPError, match="jit=True is not supported"):
        clip_model.load(tiny_checkpoint, jit=True)


def test_cache_and_bpe_names_new_first_old_still_work(tmp_path, monkeypatch):
    for name in ("CLIP_CACHE_DIR", "DEAR_CACHE_DIR", "CLIP_BPE_PATH", "DEAR_BPE_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert clip_model.default_cache_dir() == str(tmp_path / ".cache" / "clip-from-scratch")
    (tmp_path / ".cache" / "dear-from-scratch").mkdir(parents=True)  # an existing old cache is kept
    assert clip_model.default_cache_dir() == str(tmp_path / ".cache" / "dear-from-scratch")
    monkeypatch.setenv("DEAR_CACHE_DIR", "/old")
    assert clip_model.default_cache_dir() == "/old"
    monkeypatch.setenv("CLIP_CACHE_DIR", "/new")
    assert clip_model.default_cache_dir() == "/new"
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    for path in (old, new):
        path.write_text("#version: 0.2\nr e\n")
    monkeypatch.setenv("DEAR_BPE_PATH", str(old))
    assert clip_model.find_bpe_file() == str(old)
    monkeypatch.setenv("CLIP_BPE_PATH", str(new))
    assert clip_model.find_bpe_file() == str(new)


def test_tokenize_with_a_given_bpe_file(tmp_path, monkeypatch):
    monkeypatch.setattr(clip_model, "_tokenizers", {})
    path = tmp_path / "bpe.txt"
    path.write_text("#version: 0.2\nr e\nre d</w>\n")
    ids = clip_model.tokenize(["red", "a red"], context_length=8, bpe_path=str(path))
    tokenizer = clip_model.SimpleTokenizer(str(path))
    assert torch.equal(ids, tokenizer.tokenize(["red", "a red"], context_length=8))
    assert ids[0, :3].tolist() == [tokenizer.sot_token, tokenizer.encoder["red</w>"], tokenizer.eot_token]


def test_the_library_never_asserts_on_user_input():
    """`python -O` strips asserts: every check in the two library files must raise."""
    import ast

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("clip_model.py", "dear.py"):
        tree = ast.parse(open(os.path.join(root, name), encoding="utf-8").read())
        lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not lines, f"{name} asserts on lines {lines}"


def test_user_errors_raise_clip_error_naming_the_argument(tiny_clip):
    with pytest.raises(clip_model.CLIPError, match="num_layers=9"):
        clip_model.head_contributions(tiny_clip, torch.randn(1, 3, 32, 32), num_layers=9)
    with pytest.raises(clip_model.CLIPError, match="images are 30x30"):
        tiny_clip.encode_image(torch.randn(1, 3, 30, 30))
    with pytest.raises(clip_model.CLIPError, match="context length is 16"):
        tiny_clip.encode_text(torch.zeros(1, 17, dtype=torch.long))


def test_command_line_takes_head_width_and_activation_and_names_a_bad_image(tmp_path, odd_clip, capsys):
    from PIL import Image

    bpe = tmp_path / "bpe.txt"
    model_sized_bpe(bpe)  # the model's vocabulary: another size is refused (SimpleTokenizer.check_fits)
    image = tmp_path / "red.png"
    Image.new("RGB", (40, 50), (200, 10, 10)).save(image)
    foreign = tmp_path / "foreign.pt"  # two towers of heads 32 wide, GELU, nothing in the file
    torch.manual_seed(3)
    odd = perturb_(clip_model.CLIP(**dict(ODD, transformer_heads=4)), scale=0.2).eval()
    torch.save(odd.state_dict(), foreign)
    common = ["--weights", str(foreign), "--bpe", str(bpe), "--texts", "a red thing", "a blue thing"]
    assert clip_model._main(common + ["--image", str(image), "--head-width", "32", "--activation", "gelu"]) == 0
    shares = [float(line.split("%")[0]) for line in capsys.readouterr().out.strip().splitlines()]
    tokens = clip_model.SimpleTokenizer(str(bpe)).tokenize(["a red thing", "a blue thing"], 16)
    with torch.no_grad():
        expected = odd(clip_model.image_transform(32)(Image.open(image)).unsqueeze(0), tokens)[0].softmax(-1)[0]
    assert [round(100 * p, 1) for p in expected.tolist()] == shares  # the model it was told to build
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("hello")
    truncated = tmp_path / "truncated.png"  # a header that opens, pixels that do not load
    truncated.write_bytes(image.read_bytes()[:60])
    for bad in (str(not_an_image), str(truncated), str(tmp_path), str(tmp_path / "absent.png")):
        assert clip_model._main(common + ["--image", bad, "--head-width", "32"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("clip_model.py: error: ") and bad in err
        assert "Traceback" not in err and "usage" not in err
    with pytest.raises(clip_model.CLIPFileError, match="head_width=48"):  # what --head-width 48 meets
        clip_model.load(str(foreign), head_width=48)
