"""The token construction: tokens="shared" (MMRL++'s space) beside "separate" (the default).

    python -m pytest -q tests/test_shared_tokens.py

The forward pass and the gradients of both constructions are checked against the per-head
reference in test_dear_reference.py. Here: the learnable count against its formula (a tiny CLIP
with its own numbers, and ViT-B/16's 781,830 and 416,774 on a CLIP built on the meta device:
its sizes, no weights), what learns and what stays frozen, what the three special cases
(no attribute token, a blind token, the fallback to the class branch) mean under "shared", the
checkpoint names, and the refusals.
"""

import types

import pytest
import torch

import clip_model
import dear
from harness import config
import train
from conftest import TINY_DEEP, assert_close
from dear import DeAR, DeARError, HeadRole, RoleMap

ATTRIBUTES = ["colour", "shape", "texture"]
ROLE_OF = dict(G="generalization", M="mixed")
B16 = dict(embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768,
           vision_patch_size=16, vision_heads=12, context_length=77, vocab_size=49408,
           transformer_width=512, transformer_heads=8, transformer_layers=12)


def roles(tags, attributes=ATTRIBUTES, measured=False) -> RoleMap:
    """The last layer's heads by tag (an attribute, G, M); measured: with entropies, as an
    analysis makes them."""
    heads = []
    for head, tag in enumerate(tags):
        role, attribute = ("attribute", tag) if tag in attributes else (ROLE_OF[tag], None)
        heads.append(HeadRole(2, head, role, attribute, entropy=0.5 if measured else None))
    return RoleMap(TINY_DEEP["vision_layers"], TINY_DEEP["vision_heads"], list(attributes), heads)


def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def prompts():
    vocab = TINY_DEEP["vocab_size"]
    return torch.tensor([[vocab - 2, 3 * c + 5, 3 * c + 6, vocab - 1] + [0] * 12 for c in range(3)])


def shared(clip, role_map, attributes=None, **kwargs) -> DeAR:
    torch.manual_seed(0)
    return DeAR(clip, role_map, attributes, first_layer=2, beta=0.3, tokens="shared", **kwargs)


# ------------------------------------------------------------------------------------------
# What learns: the count, the names, the frozen CLIP
# ------------------------------------------------------------------------------------------


def shared_count(A, K, R, W_v, W_t, E, L_v, L_t, r=4, r_proj=64) -> int:
    """The formula: latent + each tower's map (shared weight + per layer a rank-r residual and a
    bias) + the projection's rank-64 residual + the fusion weights."""
    vision = W_v * R + L_v * (W_v * r + r * R + W_v)
    text = W_t * R + L_t * (W_t * r + r * R + W_t)
    return K * R + vision + text + (W_v * r_proj + r_proj * E) + (1 + A)


def test_the_learnable_count_is_the_formulas_on_a_tiny_clip(tiny_deep_clip):
    model = shared(tiny_deep_clip, roles(["colour", "G", "M", "shape"]))  # J = 2: 2 layers a tower
    counted = sum(p.numel() for p in model.learnable_parameters())
    # 3 x 128 + 2 x (128 x 128 + 2 x 1,152) + (128 x 64 + 64 x 32) + 4
    assert counted == shared_count(A=3, K=3, R=128, W_v=128, W_t=128, E=32, L_v=2, L_t=2) == 48_004
    assert sum(model.parameter_counts().values()) == counted
    narrow = shared(tiny_deep_clip, roles(["colour", "G", "M", "shape"]), latent_width=16)
    assert sum(p.numel() for p in narrow.learnable_parameters()) == \
        shared_count(A=3, K=3, R=16, W_v=128, W_t=128, E=32, L_v=2, L_t=2)


def test_vit_b16_counts_781830_shared_and_416774_separate_and_mmrlpps_layers_give_its_813312():
    with torch.device("meta"):  # ViT-B/16's sizes without its weights (nothing is computed)
        clip = clip_model.CLIP(**B16)
    role_map = RoleMap.uniform("mixed", 12, 12, range(8, 12))  # the five core attributes
    model = DeAR(clip, role_map, first_layer=9, tokens="shared")  # K unset: A = 5
    assert model.parameter_counts() == {
        "latent_tokens": 2_560, "vision_aligner": 393_216 + 4 * 5_888,
        "text_aligner": 262_144 + 4 * 4_608, "attribute_proj_residual": 81_920, "fusion_logits": 6}
    assert sum(p.numel() for p in model.learnable_parameters()) == 781_830 == \
        shared_count(A=5, K=5, R=512, W_v=768, W_t=512, E=512, L_v=4, L_t=4)
    separate = DeAR(clip, role_map, first_layer=9)
    assert sum(p.numel() for p in separate.learnable_parameters()) == 416_774
    # The README's copy-out script prints this line: the default construction's, as it always was.
    assert separate.parameter_summary() == (
        "learnable 416,774 parameters (vision_tokens (4, 5, 768), text_tokens (4, 4, 512), "
        "attribute_proj (768, 512), fusion_logits (6,)); frozen CLIP 149,620,737 (0.28% learnable)")
    # MMRL++'s layers 6-12 (REP_LAYERS): its own 813,312, plus DeAR's six fusion weights.
    mmrlpp_layers = DeAR(clip, role_map, first_layer=6, tokens="shared")
    assert sum(p.numel() for p in mmrlpp_layers.learnable_parameters()) == 813_312 + 6


def test_checkpoints_of_separate_keep_their_names_and_shared_ones_round_trip(tiny_deep_clip):
    separate = DeAR(tiny_deep_clip, roles(["colour", "G", "M", "shape"]), first_layer=2)
    assert list(separate.learnable_state_dict()) == ["vision_tokens", "text_tokens",
                                                     "attribute_proj", "fusion_logits"]
    model = shared(tiny_deep_clip, roles(["colour", "G", "M", "shape"]))
    state = model.learnable_state_dict()
    aligner = ["weight", "bias", "a", "b"]
    assert list(state) == (["latent_tokens"] + [f"vision_aligner.{n}" for n in aligner]
                           + [f"text_aligner.{n}" for n in aligner]
                           + [f"attribute_proj_residual.{n}" for n in "ab"] + ["fusion_logits"])
    state = {name: torch.randn_like(t) for name, t in state.items()}
    other = shared(tiny_deep_clip, roles(["colour", "G", "M", "shape"]))
    other.load_learnable_state_dict(state)
    assert all(torch.equal(other.learnable_state_dict()[n], t) for n, t in state.items())
    with pytest.raises(DeARError, match="checkpoint tensor latent_tokens has shape .* this model "
                                        "\\(tokens 'separate'\\) expects no such tensor"):
        separate.load_learnable_state_dict(state)


def test_every_shared_tensor_learns_and_no_clip_weight_gets_a_gradient(tiny_deep_clip):
    model = shared(tiny_deep_clip, roles(["colour", "G", "M", "shape"]))
    own = {name.removeprefix("tokens.") for name, _ in model.named_parameters() if not name.startswith("clip.")}
    assert set(model.learnable_tensors()) == own, "a learnable tensor is missing from the list"
    before = {name: t.clone() for name, t in model.learnable_state_dict().items()}
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=1e-2)
    for _ in range(2):  # the second step: b has left zero, so a's gradient is no longer zero
        out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
        optimizer.zero_grad()
        dear.dear_loss(out, torch.tensor([0, 2]))["total"].backward()
        assert all(p.grad is None and not p.requires_grad for p in tiny_deep_clip.parameters())
        assert tiny_deep_clip.visual.proj.grad is None  # the projection learns by its residual
        optimizer.step()
    after = model.learnable_state_dict()
    assert [n for n in before if torch.equal(before[n], after[n])] == []


# ------------------------------------------------------------------------------------------
# The special cases under "shared"
# ------------------------------------------------------------------------------------------


def test_no_attribute_tokens_keeps_the_latent_tokens_for_the_text_tower_alone(tiny_deep_clip):
    mixed = RoleMap.uniform("mixed", 3, 4, [2], [])
    model = shared(tiny_deep_clip, mixed, [], num_text_tokens=3)  # A = 0: K is the run's, here 3
    assert list(model.parameter_counts()) == ["latent_tokens", "text_aligner", "fusion_logits"]
    assert model.tokens.vision_aligner is None and model.tokens.attribute_proj_residual is None  # no vision map
    out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    assert out.image_features.shape[1] == 1 and out.alpha.tolist() == [1.0]  # the class branch
    assert_close(out.image_features[:, 0], out.frozen_image_features, 1e-5, "frozen CLIP's image")
    assert (out.text_features - out.frozen_text_features).abs().max() > 1e-3  # the text tokens act
    dear.dear_loss(out, torch.tensor([0, 2]))["total"].backward()
    assert model.tokens.latent_tokens.grad.abs().max() > 0  # ... and learn


def test_without_attribute_tokens_python_and_train_py_give_the_same_K_and_nothing_acts_on_nothing(
        tiny_deep_clip):
    """The one K rule (dear.default_text_tokens): a shared row without attribute tokens keeps its
    full row's K = A. train.py resolves K before the ablation; from Python it is passed (unset:
    refused). With K = 0 too, no latent token and no map is built: only the fusion weight."""
    analysed = roles(["colour", "G", "M", "shape"])
    settings = dict(tokens="shared", text_tokens=None, beta=0.3, first_layer=2, lambda_fusion=0.1,
                    lambda_reg=1.0)
    config.resolve_text_tokens(settings, len(ATTRIBUTES))  # train.py's K, once per call
    inputs = types.SimpleNamespace(clip=tiny_deep_clip, attributes=ATTRIBUTES)
    change = dear.ablate("no-attribute-tokens", analysed, ATTRIBUTES, 0.1)
    by_train = train.build_dear(settings, inputs, change)
    by_python = DeAR(tiny_deep_clip, change.role_map, change.attributes, first_layer=2, beta=0.3,
                     tokens="shared", num_text_tokens=dear.default_text_tokens("shared", 3))
    assert by_train.num_text_tokens == by_python.num_text_tokens == 3
    aligner = [f"text_aligner.{n}" for n in ("weight", "bias", "a", "b")]
    assert list(by_train.learnable_tensors()) == list(by_python.learnable_tensors()) == \
        ["latent_tokens", *aligner, "fusion_logits"]
    with pytest.raises(DeARError, match="tokens 'shared' without attribute tokens: give num_text_tokens"):
        DeAR(tiny_deep_clip, change.role_map, [], first_layer=2, tokens="shared")
    empty = DeAR(tiny_deep_clip, change.role_map, [], first_layer=2, tokens="shared", num_text_tokens=0)
    assert list(empty.learnable_tensors()) == ["fusion_logits"]
    assert [name for name, _ in empty.tokens.named_parameters()] == []
    out = empty(images(), empty.prepare_classes(prompts()), with_frozen=True)
    assert_close(out.image_features[:, 0], out.frozen_image_features, 1e-5, "frozen CLIP's image")
    assert_close(out.text_features, out.frozen_text_features, 1e-5, "frozen CLIP's text")


def test_a_blind_token_exists_feeds_the_text_tower_and_leaves_the_fusion(tiny_deep_clip):
    # J = 3: the last layer alone holds tokens; no head of it lets the texture token read the image.
    torch.manual_seed(0)
    role_map = roles(["colour", "G", "shape", "G"])
    model = DeAR(tiny_deep_clip, role_map, first_layer=3, tokens="shared")
    assert model.blind_attributes == ["texture"]
    classes = model.prepare_classes(prompts())
    out = model(images(), classes)
    assert out.alpha[3].item() == 0 and out.alpha[1].item() > 0  # texture's branch out, colour's in
    assert model.tokens.vision_layer_tokens().shape[1] == 3  # the blind token is still in the vision tower
    with torch.no_grad():
        text_before = model.encode_text(classes)
        model.tokens.latent_tokens[2] += 0.5  # the texture token
        assert (model.encode_text(classes) - text_before).abs().max() > 1e-4  # it feeds the text
    assert "texture" not in dear.retrieval_features(model, images())  # a blind token ranks nothing


def test_the_fallback_leaves_every_attribute_branch_out_of_the_fusion(tiny_deep_clip):
    with pytest.warns(UserWarning, match="falling back to the class branch alone"):
        model = shared(tiny_deep_clip, roles(["G", "M", "G", "M"], measured=True))
    assert model.class_branch_only
    out = model(images(), model.prepare_classes(prompts()))
    assert out.alpha.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert model.tokens.latent_tokens.shape == (3, 128)  # the tokens still exist and reach both towers


# ------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens="shared", num_text_tokens=4),
     "K = 4 text tokens: under tokens 'shared' the text tower receives the A = 3 tokens"),
    (dict(tokens="joint"), "tokens='joint': use separate or shared"),
    (dict(latent_width=16), "latent_width=16: the latent tokens' width, 1 or more, for tokens="),
    (dict(tokens="shared", latent_width=0), "latent_width=0"),
])
def test_a_bad_token_setting_is_one_line(tiny_deep_clip, kwargs, message):
    with pytest.raises(DeARError, match=message.replace("(", "\\(")) as error:
        DeAR(tiny_deep_clip, roles(["colour", "G", "M", "shape"]), first_layer=2, **kwargs)
    assert "\n" not in str(error.value)
