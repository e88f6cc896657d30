"""Tests for dear.py: the method's invariants on a small random CLIP.

    python -m pytest -q tests/test_dear.py

What they pin down: within one layer, a generalization head's output at the image tokens
does not depend on the attribute tokens (checked by gradients, not by reading the mask; across
layers it may, through image tokens that earlier attribute and mixed heads wrote into, see
test_dear_invariants.py); with every head generalization the class feature is plain CLIP's;
an attribute head carries exactly its own token into the image; TextSpan finds planted directions; concept entropy and roles on hand-computed
cases; prepared class lists kept apart; bad input. (That the fast path -- no autograd
before J, the shared frozen prefix, the text side prepared once and cut short -- equals the
plain computation, gradients included, is checked in test_dear_reference.py.)
"""

import json
import math
import os

import pytest
import torch

import clip_model
import dear
from harness.bank import project_bank
from harness import pictures
from conftest import TINY, assert_close
from dear import DeAR, DeARError, HeadRole, RoleMap

ATTRIBUTES = list(dear.CORE_ATTRIBUTES)
LAYERS, HEADS = TINY["vision_layers"], TINY["vision_heads"]  # 3 layers of 2 heads
N_IMAGE = 1 + (TINY["image_resolution"] // TINY["vision_patch_size"]) ** 2  # CLS + 16 patches


def role_map(spec: dict, layers=None) -> RoleMap:
    """spec: {(layer, head): "G" | "M" | attribute name}; unlisted heads are mixed."""
    layers = range(LAYERS) if layers is None else layers
    heads = []
    for layer in layers:
        for head in range(HEADS):
            tag = spec.get((layer, head), "M")
            if tag in ("G", "M"):
                heads.append(HeadRole(layer, head, {"G": "generalization", "M": "mixed"}[tag]))
            else:
                heads.append(HeadRole(layer, head, "attribute", tag))
    return RoleMap(LAYERS, HEADS, ATTRIBUTES, heads)


def class_prompts(num_classes=4, seed=0):
    """Token ids (C, context) of different lengths, end-of-text = the largest id."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(num_classes, TINY["context_length"], dtype=torch.long)
    for c in range(num_classes):
        length = 3 + c % 4
        ids[c, 0] = TINY["vocab_size"] - 2  # start
        ids[c, 1:length] = torch.randint(1, TINY["vocab_size"] - 2, (length - 1,), generator=generator)
        ids[c, length] = TINY["vocab_size"] - 1  # end
    return ids


def images(batch=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, TINY["image_resolution"], TINY["image_resolution"], generator=generator)


def make_model(tiny_clip, spec=None, first_layer=2, **kwargs) -> DeAR:
    torch.manual_seed(5)
    model = DeAR(tiny_clip, role_map(spec or {}), ATTRIBUTES, first_layer=first_layer, **kwargs)
    with torch.no_grad():
        model.tokens.vision_tokens.normal_(0, 1.0)  # large tokens: any leak would show
        model.tokens.text_tokens.normal_(0, 1.0)
    return model


# ------------------------------------------------------------------------------------------
# Isolation: within a layer, generalization heads do not read attribute tokens
# ------------------------------------------------------------------------------------------


def test_all_generalization_heads_give_the_frozen_class_feature_whatever_the_tokens(tiny_clip):
    all_general = {(l, h): "G" for l in range(LAYERS) for h in range(HEADS)}
    model = make_model(tiny_clip, all_general, first_layer=1)
    x = images()
    with torch.no_grad():
        f_cls, _, _ = model.encode_image(x)
        model.tokens.vision_tokens.mul_(-3.0).add_(7.0)  # entirely different attribute tokens
        f_cls_other, _, _ = model.encode_image(x)
        frozen = tiny_clip.encode_image(x)
    assert torch.equal(f_cls, f_cls_other), "the class feature depends on the attribute tokens"
    assert_close(f_cls, frozen, 1e-5, "class feature vs frozen CLIP")


def test_no_gradient_reaches_attribute_tokens_when_every_head_is_generalization(tiny_clip):
    all_general = {(l, h): "G" for l in range(LAYERS) for h in range(HEADS)}
    model = make_model(tiny_clip, all_general, first_layer=1)
    f_cls, f_attr, _ = model.encode_image(images())
    f_cls.square().sum().backward()
    assert model.tokens.vision_tokens.grad is None or model.tokens.vision_tokens.grad.abs().max() == 0
    # Sanity check that the same test fails when heads are mixed:
    mixed = make_model(tiny_clip, {}, first_layer=1)
    f_cls, _, _ = mixed.encode_image(images())
    f_cls.square().sum().backward()
    assert mixed.tokens.vision_tokens.grad.abs().max() > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_gradient_flows_from_attribute_tokens_into_a_generalization_heads_output(tiny_clip, seed):
    # Random role maps; in every layer from J on, the output of each generalization head at
    # the image tokens must have an exactly zero gradient with respect to the attribute tokens
    # entering that layer. Mixed and attribute heads must have a nonzero one (else the test
    # could not fail).
    generator = torch.Generator().manual_seed(seed)
    choices = ["G", "M"] + ATTRIBUTES
    spec = {(l, h): choices[int(torch.randint(len(choices), (1,), generator=generator))]
            for l in range(LAYERS) for h in range(HEADS)}
    spec[(1, 0)], spec[(2, 1)] = "G", "colour"  # each kind present at least once
    model = make_model(tiny_clip, spec, first_layer=2)
    blocks = tiny_clip.visual.transformer.resblocks
    image_tokens = torch.randn(2, N_IMAGE, TINY["vision_width"])
    for i, layer in enumerate(range(1, LAYERS)):
        attribute_tokens = torch.randn(2, len(ATTRIBUTES), TINY["vision_width"], requires_grad=True)
        sequence = torch.cat([image_tokens, attribute_tokens], dim=1)
        _, details = blocks[layer].attn(blocks[layer].ln_1(sequence), model.role_masks[i], return_details=True)
        for head in range(HEADS):
            (grad,) = torch.autograd.grad(details.head_outputs[:, head, :N_IMAGE].sum(), attribute_tokens,
                                          retain_graph=True)
            per_token = grad.abs().sum(dim=(0, 2))  # (A,)
            tag = spec[(layer, head)]
            if tag == "G":
                assert per_token.max() == 0, f"layer {layer} head {head}: generalization head reads tokens"
            elif tag == "M":
                assert (per_token > 0).all(), f"layer {layer} head {head}: mixed head blind to tokens"
            else:
                a = ATTRIBUTES.index(tag)
                assert per_token[a] > 0 and per_token[torch.arange(len(ATTRIBUTES)) != a].max() == 0, (
                    f"layer {layer} head {head}: attribute head for {tag} reads {per_token.tolist()}")


def test_an_attribute_head_carries_only_its_own_token_to_the_cls_token(tiny_clip):
    # Layers 2 and 3 (1-based) from J = 2: head 0 is the colour head, head 1 a generalization head.
    spec = {(l, 0): "colour" for l in range(1, LAYERS)} | {(l, 1): "G" for l in range(1, LAYERS)}
    model = make_model(tiny_clip, spec, first_layer=2)
    f_cls, _, _ = model.encode_image(images())
    f_cls.square().sum().backward()
    grad = model.tokens.vision_tokens.grad.abs().sum(dim=(0, 2))  # (A,): over layers and channels
    colour = ATTRIBUTES.index("colour")
    assert grad[colour] > 0
    others = [a for a in range(len(ATTRIBUTES)) if a != colour]
    assert grad[others].max() == 0, f"other attribute tokens reach the CLS token: {grad.tolist()}"


def test_no_mask_row_is_all_minus_infinity(tiny_clip):
    for spec in ({}, {(l, h): "G" for l in range(LAYERS) for h in range(HEADS)},
                 {(l, h): ATTRIBUTES[(l + h) % 5] for l in range(LAYERS) for h in range(HEADS)}):
        masks = make_model(tiny_clip, spec, first_layer=1).role_masks  # (layers, H, T, T)
        assert masks.shape == (LAYERS, HEADS, N_IMAGE + 5, N_IMAGE + 5)
        assert (masks == 0).any(dim=-1).all()


def test_head_mask_rules_by_hand():
    N, A = 2, 3
    minus = float("-inf")
    general = dear.head_mask("generalization", None, N, A)
    expected = torch.full((5, 5), minus)
    expected[:2, :2] = 0
    expected[2, 2] = expected[3, 3] = expected[4, 4] = 0
    assert torch.equal(general, expected)
    attribute = dear.head_mask("attribute", 1, N, A)  # token index 2 + 1 = 3
    expected[:2, 3] = 0
    expected[3, :2] = 0
    assert torch.equal(attribute, expected)
    assert torch.equal(dear.head_mask("mixed", None, N, A), torch.zeros(5, 5))
    text = dear.format_head_mask(attribute, N, ["colour", "shape", "texture"])
    assert text.splitlines()[1].split() == ["image", "#", ".", "#", "."]


# ------------------------------------------------------------------------------------------
# TextSpan, concept entropy, roles
# ------------------------------------------------------------------------------------------


def test_textspan_recovers_planted_directions():
    generator = torch.Generator().manual_seed(0)
    E, T = 64, 200
    bank = torch.nn.functional.normalize(torch.randn(T, E, generator=generator), dim=-1)
    planted = [17, 123, 5]
    strengths = [5.0, 3.0, 1.5]  # most variance first
    n = 300
    contributions = sum(s * torch.randn(n, 1, generator=generator) * bank[p] for s, p in zip(strengths, planted))
    contributions = contributions + 0.05 * torch.randn(n, E, generator=generator)
    picks = dear.textspan(contributions, bank, num_descriptions=5, rank=80)
    assert picks[:3] == planted
    assert len(set(picks)) == 5


@pytest.mark.parametrize("concepts, bits", [
    (["colour"] * 20, 0.0),
    (["colour"] * 10 + ["shape"] * 10, 1.0),
    (["colour", "shape", "texture", "object"] * 5, 2.0),
    (["colour", "colour", "shape", "texture"], 1.5),
    (["colour"] * 15 + ["style"] * 5, -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))),
])
def test_concept_entropy_by_hand(concepts, bits):
    assert dear.concept_entropy(concepts) == pytest.approx(bits, abs=1e-12)


def test_roles_by_hand():
    entropies = [0.0, 0.2, 1.0, 1.5, 2.5, 3.0]
    concepts = [["colour"] * 8, ["style"] * 8, ["shape"], ["shape"], ["object"], ["object"]]
    low, high = dear.default_thresholds(8, 12)
    # 8 picks over 12 concepts spread at most log2(8) = 3 bits: thirds at 1 and 2 bits.
    assert (low, high) == pytest.approx((1.0, 2.0))
    dominants = [dear.dominant_concept(c) for c in concepts]
    roles = dear.assign_roles(entropies, dominants, ATTRIBUTES, low, high)
    assert roles == [("attribute", "colour"), ("generalization", None), ("attribute", "shape"), ("mixed", None),
                     ("generalization", None), ("generalization", None)]
    roles = dear.assign_roles(entropies, dominants, ATTRIBUTES, low_bits=0.5, high_bits=2.9)
    assert roles[2] == ("mixed", None) and roles[4] == ("mixed", None)
    with pytest.raises(DeARError, match="low threshold"):
        dear.assign_roles(entropies, dominants, ATTRIBUTES, low_bits=2.0, high_bits=1.0)


def test_thresholds_are_thirds_of_what_the_picks_can_spread_with_three_picks_in_four_a_specialist():
    three_in_four = dear.concept_entropy(["position", "background", "position", "position"])  # 0.81 bits
    assert dear.default_thresholds(20, 12) == pytest.approx((math.log2(12) / 3, 2 * math.log2(12) / 3))
    assert dear.default_thresholds(4, 7) == pytest.approx((three_in_four, 4 / 3))  # a third (0.67) asks 4 of 4
    assert dear.default_thresholds(3, 7) == pytest.approx((three_in_four, 2 * math.log2(3) / 3))
    assert dear.default_thresholds(2, 7) == pytest.approx((1 / 3, 2 / 3))  # 0.81 is not under high: a third
    # Four picks: 3 of 4 on a core attribute is a specialist (a position head that also sees the
    # background); 2 and 2 is mixed; 2, 1 and 1 a generalist.
    picks = [["position", "background", "position", "position"], ["shape", "colour", "shape", "colour"],
             ["shape", "colour", "texture", "shape"]]
    roles = dear.assign_roles([dear.concept_entropy(c) for c in picks], [dear.dominant_concept(c) for c in picks],
                              ATTRIBUTES + ["position"], *dear.default_thresholds(4, 7))
    assert roles == [("attribute", "position"), ("mixed", None), ("generalization", None)]
    # Ten heads, none specialised (two concepts of three picks each): no attribute head is made.
    spread = [["colour", "colour", "shape"], ["shape", "texture", "shape"]] * 5
    entropies = [dear.concept_entropy(c) for c in spread]
    roles = dear.assign_roles(entropies, [dear.dominant_concept(c) for c in spread], ATTRIBUTES,
                              *dear.default_thresholds(3, 7))
    assert {role for role, _ in roles} == {"mixed"}


def test_default_picks_follow_the_fewest_values_of_an_attribute():
    bank = [(f"a {v} thing", "colour", v) for v in ("red", "green", "blue")]
    bank += [(f"something {v}", "colour", v) for v in ("red", "green", "blue")]  # a second template
    bank += [(f"a {v}", "shape", v) for v in ("circle", "square", "star", "cross", "ring")]
    bank += [(f"at {v}", "place", v) for v in ("left", "right")]  # not an attribute: no say
    assert dear.default_picks(bank, ["colour", "shape"]) == 3  # colour: 3 values
    assert dear.default_picks([b[:2] for b in bank], ["colour", "shape"]) == 5  # no values: each phrase its own
    assert dear.default_picks(project_bank(), ATTRIBUTES) == 16  # shape's 16 words
    assert dear.default_picks(project_bank(), ATTRIBUTES, paper=True) == dear.PAPER_PICKS == 20
    with pytest.raises(DeARError, match="no phrase of any attribute"):
        dear.default_picks(bank, ["texture"])


def test_default_picks_let_a_pure_specialist_reach_zero_bits():
    """A head that carries a 4-valued attribute varies inside the span of its 4 value phrases:
    4 picks explain it entirely (0 bits); a 5th has nothing of it left and lands elsewhere."""
    generator = torch.Generator().manual_seed(0)
    bank = [(f"{c} {v}", c, str(v)) for c, k in (("position", 4), ("colour", 8), ("scene", 12)) for v in range(k)]
    text = torch.nn.functional.normalize(torch.randn(len(bank), 32, generator=generator), dim=-1)
    values = torch.randint(0, 4, (300,), generator=generator)
    head = text[values] + 0.01 * torch.randn(300, 32, generator=generator)  # (images, E): position only
    picks = dear.textspan(head, text, dear.default_picks(bank, ["position", "colour"]), rank=32)
    assert [bank[i][1] for i in picks] == ["position"] * 4
    fifth = dear.textspan(head, text, 5, rank=32)[4]
    assert bank[fifth][1] != "position"


def test_dominant_concept_ties_go_to_the_first_found():
    assert dear.dominant_concept(["shape", "colour", "colour", "shape", "texture"]) == "shape"


def test_the_description_bank_is_large_labelled_and_unique():
    bank = project_bank()
    concepts = {d.concept for d in bank}
    assert len(bank) >= 500 and len(concepts) >= 10
    assert set(dear.CORE_ATTRIBUTES) <= concepts
    assert len({d.text for d in bank}) == len(bank)


def test_analysis_end_to_end_writes_json_table_and_heatmap(tiny_clip, tmp_path):
    bpe = tmp_path / "bpe.txt"
    bpe.write_text("#version: 0.2\nr e\nre d</w>\n")
    tokenizer = clip_model.SimpleTokenizer(str(bpe))
    # The tiny model's vocabulary (600) is larger than this tokenizer's (517): ids fit.
    batches = [images(8, seed=s) for s in range(3)]
    lines = []
    result = dear.analyze_heads(tiny_clip, batches, tokenizer, project_bank(), num_layers=2, num_descriptions=6,
                                log=lines.append)
    assert result.layers == [1, 2] and len(result.heads) == 2 * HEADS
    assert all(len(h.descriptions) == 6 and h.entropy is not None for h in result.heads)
    assert {h.role for h in result.heads} <= set(dear.ROLES)
    assert any("layer 3 (index 2)" in line for line in lines)

    path = tmp_path / "roles.json"
    result.save(str(path))
    again = RoleMap.load(str(path))
    assert again == result
    assert json.loads(path.read_text())["heads"][0]["layer"] == 1
    table = result.table()
    assert "\n    2 |" in table and "\n    3 |" in table  # 1-based layer numbers
    picture = tmp_path / "roles.png"
    pictures.draw_heatmap(result, str(picture))
    from PIL import Image

    with Image.open(picture) as drawn:
        assert drawn.size[0] >= 200 and len(drawn.getcolors(maxcolors=1 << 16)) > 3


# ------------------------------------------------------------------------------------------
# The forward pass and the losses
# ------------------------------------------------------------------------------------------


def test_fused_logits_are_the_alpha_weighted_branches_and_losses_are_as_specified(tiny_clip):
    model = make_model(tiny_clip, {(1, 0): "shape", (2, 1): "G"})
    out = model(images(), model.prepare_classes(class_prompts()), with_frozen=True)
    assert out.branch_logits.shape == (3, 1 + 5, 4) and out.logits.shape == (3, 4)
    assert_close(out.alpha, torch.tensor([0.5] + [0.1] * 5), 1e-6, "initial fusion weights")
    assert_close(out.logits, (out.branch_logits * out.alpha[None, :, None]).sum(1), 1e-5, "fusion")
    labels = torch.tensor([0, 3, 1])
    losses = dear.dear_loss(out, labels, lambda_reg=2.0, lambda_fusion=0.5)
    assert losses["fusion"].item() == pytest.approx(math.log(2))
    expected_reg = (1 - torch.cosine_similarity(out.image_features[:, 0], out.frozen_image_features).mean()
                    + 1 - torch.cosine_similarity(out.text_features, out.frozen_text_features).mean())
    assert losses["reg"].item() == pytest.approx(expected_reg.item(), abs=1e-6)
    ce = torch.nn.functional.cross_entropy(out.logits, labels)
    assert losses["total"].item() == pytest.approx((ce + 2.0 * expected_reg + 0.5 * math.log(2)).item(), abs=1e-5)
    losses["total"].backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.learnable_parameters())
    assert all(p.grad is None for p in tiny_clip.parameters())  # CLIP stays frozen


def test_frozen_features_are_plain_clip(tiny_clip):
    model = make_model(tiny_clip)
    prompts = class_prompts()
    out = model(images(), model.prepare_classes(prompts), with_frozen=True)
    with torch.no_grad():
        assert_close(out.frozen_image_features, tiny_clip.encode_image(images()), 1e-5, "frozen image")
        assert_close(out.frozen_text_features, tiny_clip.encode_text(prompts), 1e-5, "frozen text")


def test_zero_text_tokens_leave_clip_text_features_unchanged(tiny_clip):
    model = make_model(tiny_clip, num_text_tokens=0)
    prompts = class_prompts()
    classes = model.prepare_classes(prompts)
    assert_close(model.encode_text(classes), classes.frozen, 1e-5, "no text tokens = plain CLIP")


def test_each_prepared_class_list_keeps_its_own_text_side(tiny_clip):
    # prepare_classes returns the class list's state; nothing of it is kept in the model, so
    # preparing a second list (here of another size) leaves the first one's features alone.
    model = make_model(tiny_clip)
    first, second = class_prompts(4, seed=0), class_prompts(3, seed=9)
    with torch.no_grad():
        prepared_first = model.prepare_classes(first)
        prepared_second = model.prepare_classes(second)
        t_first, t_second = model.encode_text(prepared_first), model.encode_text(prepared_second)
        assert t_first.shape[0] == 4 and t_second.shape[0] == 3
        assert_close(model.encode_text(model.prepare_classes(first)), t_first, 1e-6, "first list, prepared again")
        assert_close(prepared_second.frozen, tiny_clip.encode_text(second), 1e-5, "frozen second list")


def test_token_ids_in_place_of_prepared_classes_are_refused_with_the_way_to_prepare_them(tiny_clip):
    model = make_model(tiny_clip)
    with pytest.raises(DeARError, match=r"model.prepare_classes\(class_token_ids\), got a Tensor"):
        model(images(), class_prompts(), with_frozen=True)


def test_learnable_state_round_trips(tiny_clip):
    model = make_model(tiny_clip)
    state = model.learnable_state_dict()
    other = make_model(tiny_clip)
    with torch.no_grad():
        other.tokens.vision_tokens.zero_()
    other.load_learnable_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(model.learnable_parameters(), other.learnable_parameters()))
    with pytest.raises(DeARError, match="vision_tokens has shape"):
        other.load_learnable_state_dict({"vision_tokens": torch.zeros(1, 2, 3)})


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_role_file_for_another_architecture_is_refused(tiny_clip, tmp_path):
    wrong_heads = RoleMap(LAYERS, 12, ATTRIBUTES, [HeadRole(2, h, "mixed") for h in range(12)])
    path = tmp_path / "b16_roles.json"
    wrong_heads.save(str(path))
    loaded = RoleMap.load(str(path))
    with pytest.raises(DeARError) as error:
        DeAR(tiny_clip, loaded, ATTRIBUTES, first_layer=2)
    assert "12 heads per layer" in _one_line(error) and "this model has 2" in str(error.value)
    wrong_layers = RoleMap(12, HEADS, ATTRIBUTES, [HeadRole(11, h, "mixed") for h in range(HEADS)])
    with pytest.raises(DeARError) as error:
        DeAR(tiny_clip, wrong_layers, ATTRIBUTES, first_layer=2)
    assert "12 layers" in _one_line(error)


def test_a_role_file_with_an_unknown_attribute_is_refused(tmp_path):
    path = tmp_path / "roles.json"
    role_map({(2, 0): "colour"}).save(str(path))
    data = json.loads(path.read_text())
    data["heads"][4]["attribute"] = "smell"
    path.write_text(json.dumps(data))
    with pytest.raises(DeARError) as error:
        RoleMap.load(str(path))
    message = _one_line(error)
    assert str(path) in message and "'smell'" in message and "colour" in message


def test_a_broken_or_missing_role_file_is_named(tmp_path):
    path = tmp_path / "roles.json"
    path.write_text("{ not json")
    with pytest.raises(DeARError) as error:
        RoleMap.load(str(path))
    assert str(path) in _one_line(error) and "not a DeAR role file" in str(error.value)
    with pytest.raises(DeARError) as error:
        RoleMap.load(str(tmp_path / "absent.json"))
    # A library error names functions and arguments, never a command-line flag.
    assert "RoleMap.uniform" in _one_line(error) and "--" not in str(error.value)


def test_unknown_attribute_names_in_the_model_are_refused(tiny_clip):
    with pytest.raises(DeARError) as error:
        DeAR(tiny_clip, role_map({}), ["colour", "smell"], first_layer=2)
    assert "attributes" in _one_line(error)


@pytest.mark.parametrize("first_layer", [0, 4, -1])
def test_first_layer_out_of_range_is_refused(tiny_clip, first_layer):
    with pytest.raises(DeARError) as error:
        DeAR(tiny_clip, role_map({}), ATTRIBUTES, first_layer=first_layer)
    assert f"J={first_layer}" in _one_line(error) and "1..2" in str(error.value)


@pytest.mark.parametrize("beta", [-0.1, 1.5])
def test_beta_outside_zero_one_is_refused(tiny_clip, beta):
    with pytest.raises(DeARError) as error:
        DeAR(tiny_clip, role_map({}), ATTRIBUTES, first_layer=2, beta=beta)
    assert f"beta={beta}" in _one_line(error)


def test_uniform_role_maps_for_the_ablations(tiny_clip):
    general = RoleMap.uniform("generalization", LAYERS, HEADS, range(LAYERS))
    assert {h.role for h in general.heads} == {"generalization"} and general.source == "all-generalization"
    model = DeAR(tiny_clip, RoleMap.uniform("mixed", LAYERS, HEADS, range(LAYERS)), ATTRIBUTES, first_layer=1)
    assert (model.role_masks == 0).all()
    with pytest.raises(DeARError):
        RoleMap.uniform("attribute", LAYERS, HEADS, range(LAYERS))


def test_atomic_write_leaves_a_normally_readable_file_and_no_temporary(tmp_path):
    path = tmp_path / "roles.json"
    dear.clip_model.atomic_write(str(path), lambda tmp: open(tmp, "w").write("{}"))
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o666 & ~umask  # not mkstemp's private 0600
    assert [p.name for p in tmp_path.iterdir()] == ["roles.json"]


# ------------------------------------------------------------------------------------------
# Library defaults and behaviour for callers outside this project
# ------------------------------------------------------------------------------------------


def test_deep_models_default_j_to_the_first_of_their_last_four_layers_and_take_the_maps_attributes():
    torch.manual_seed(0)
    six = clip_model.CLIP(**dict(TINY, vision_layers=6, transformer_layers=6)).eval()
    heads = [HeadRole(layer, head, "attribute", "shape") if (layer, head) == (5, 0) else
             HeadRole(layer, head, "mixed") for layer in range(2, 6) for head in range(HEADS)]
    roles = RoleMap(6, HEADS, ["shape", "colour"], heads)
    model = DeAR(six, roles)  # no attributes, no first_layer
    assert model.first_layer == 3  # 1-based: layers 3-6 are the last four of six
    assert model.attributes == ["shape", "colour"] and model.tokens.vision_tokens.shape[:2] == (4, 2)
    # ... and the caller's CLIP is frozen in place, as the docstring says.
    assert model.clip is six and not any(p.requires_grad for p in six.parameters()) and not six.training
    with pytest.raises(DeARError, match="leave DeAR's attributes out"):
        DeAR(six, roles, attributes=["colour", "shape"])


def test_analyze_heads_takes_one_tensor_of_images_as_well_as_batches(tiny_clip, tmp_path):
    bpe = tmp_path / "bpe.txt"
    bpe.write_text("#version: 0.2\nr e\nre d</w>\n")
    tokenizer = clip_model.SimpleTokenizer(str(bpe))
    batches = [images(8, seed=s) for s in range(2)]
    quiet = dict(bank=project_bank(), num_descriptions=6, log=lambda line: None)
    from_batches = dear.analyze_heads(tiny_clip, batches, tokenizer, **quiet)
    from_tensor = dear.analyze_heads(tiny_clip, torch.cat(batches), tokenizer, **quiet)
    assert from_tensor == from_batches and from_tensor.layers == [0, 1, 2]  # all 3 layers (fewer than 4)
    with pytest.raises(DeARError, match="image_batches must be"):
        dear.analyze_heads(tiny_clip, [(batches[0], torch.zeros(8))], tokenizer, **quiet)  # (images, labels)


def test_dear_loss_without_frozen_features_raises_a_named_error(tiny_clip):
    model = make_model(tiny_clip)
    output = model(images(2), model.prepare_classes(class_prompts()), with_frozen=False)
    with pytest.raises(DeARError, match="with_frozen=True"):
        dear.dear_loss(output, torch.tensor([0, 1]))


def test_importing_dear_leaves_the_umask_alone_and_files_follow_it(tmp_path):
    """Run in a fresh process: os.umask is booby-trapped before dear.py is imported."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import os, sys; os.umask(0o027); "
            "os.umask = lambda *a: sys.exit('dear.py called os.umask'); "
            f"sys.path.insert(0, {root!r}); import dear; "
            f"dear.clip_model.atomic_write({str(tmp_path / 'roles.json')!r}, lambda t: open(t, 'w').write('{{}}'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ((tmp_path / "roles.json").stat().st_mode & 0o777) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["roles.json"]


# ------------------------------------------------------------------------------------------
# Attribute-conditioned retrieval
# ------------------------------------------------------------------------------------------


def test_rank_gallery_orders_by_cosine_and_keeps_a_query_out_of_its_own_list():
    angles = torch.tensor([0.0, 0.1, 0.5, 1.2, 3.0])  # on the unit circle: cosine falls with the angle gap
    gallery = torch.stack([angles.cos(), angles.sin()], dim=1)  # (5, 2)
    queries = gallery[[0, 3]]
    assert dear.rank_gallery(queries, gallery, 3).tolist() == [[0, 1, 2], [3, 2, 1]]
    ranked = dear.rank_gallery(gallery, gallery, 2, same_images=True)
    assert ranked.tolist() == [[1, 2], [0, 2], [1, 0], [2, 1], [3, 2]]
    assert dear.rank_gallery(gallery, gallery, 10, same_images=True).shape == (5, 4)  # never itself


def test_precision_at_k_by_hand():
    ranking = torch.tensor([[1, 2, 3], [0, 2, 3]])
    values = ["red", "red", "blue", "red"]
    # query 0 (red): red, blue, red -> 2/3; query 1 (red): red, blue, red -> 2/3
    assert dear.precision_at_k(ranking, values, values) == pytest.approx(2 / 3)
    assert dear.precision_at_k(ranking, ["blue", "blue"], values) == pytest.approx(1 / 3)


def test_retrieval_features_leave_a_blind_token_out(tiny_clip):
    # colour has an attribute head; no head is mixed; every other token is blind.
    spec = {(l, h): "G" for l in range(LAYERS) for h in range(HEADS)}
    spec[(2, 0)] = "colour"
    with pytest.warns(UserWarning, match="left out of the fusion"):
        model = make_model(tiny_clip, spec)
    features = dear.retrieval_features(model, images(4))
    assert list(features) == ["class", "colour", "frozen CLIP"]
    assert all(f.shape == (4, TINY["embed_dim"]) for f in features.values())
    assert_close(features["colour"].norm(dim=-1), torch.ones(4), 1e-5, "normalised")
    f_cls, f_attr, f_frozen = model.encode_image(images(4), with_frozen=True)
    assert_close(features["colour"], torch.nn.functional.normalize(f_attr[:, 0], dim=-1), 1e-6, "colour token")
    assert_close(features["frozen CLIP"], torch.nn.functional.normalize(f_frozen, dim=-1), 1e-6, "frozen CLIP")


def test_a_measured_map_without_attribute_heads_falls_back_to_the_class_branch(tiny_clip):
    """No head specialised enough (entropies measured, none low): alpha = (1, 0, ..., 0), so the
    fused logits are the class branch's. A hand-made map (the all-mixed ablation) keeps every
    branch, and one measured attribute head is enough to keep the fusion."""
    measured = role_map({})
    for head in measured.heads:
        head.entropy = 1.5
    model = DeAR(tiny_clip, measured, ATTRIBUTES, first_layer=2, cls_fusion_weight=0.3)
    assert model.class_branch_only and dear.falls_back_to_class_branch(measured)
    assert model.fusion_weights().tolist() == [1.0] + [0.0] * len(ATTRIBUTES)
    out = model(images(), model.prepare_classes(class_prompts()))
    assert torch.equal(out.logits, out.branch_logits[:, 0])
    mixed = DeAR(tiny_clip, RoleMap.uniform("mixed", LAYERS, HEADS, range(LAYERS)), ATTRIBUTES, first_layer=2,
                 cls_fusion_weight=0.3)
    assert not mixed.class_branch_only and abs(mixed.fusion_weights()[0].item() - 0.3) < 1e-6
    measured.heads[-1].role, measured.heads[-1].attribute, measured.heads[-1].entropy = "attribute", ATTRIBUTES[0], 0.0
    kept = DeAR(tiny_clip, measured, ATTRIBUTES, first_layer=2, cls_fusion_weight=0.3)
    assert not kept.class_branch_only and abs(kept.fusion_weights()[0].item() - 0.3) < 1e-6


@pytest.mark.parametrize("fusion, trained, logits", [
    ("fused-everywhere", True, "fused"), ("fused-everywhere", False, "fused"),
    ("class-on-unseen", True, "fused"), ("class-on-unseen", False, "class"),
])
def test_scoring_logits_under_each_fusion_rule(fusion, trained, logits):
    """Which logits score a test set: the fused ones on the trained classes under both rules; on
    classes not trained, the fused ones (fused-everywhere) or the class branch alone (MMRL's)."""
    assert dear.scoring_logits(fusion, trained) == logits


def test_scoring_logits_refuses_an_unknown_fusion_rule():
    with pytest.raises(DeARError, match="fusion='fused': use fused-everywhere or class-on-unseen"):
        dear.scoring_logits("fused", True)
