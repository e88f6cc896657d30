"""DeAR's invariants that the reference forward (test_dear_reference.py) does not reach.

    python -m pytest -q tests/test_dear_invariants.py

Gradient routing of the self-regularisation; one optimizer step moves every learnable tensor
and no CLIP weight; beta = 0 and beta = 1 as the spec defines them, read at the blocks'
inputs; each prepared class list gives its own text features, whatever its shape; TextSpan's
rank and its removal of each chosen direction from the bank; the role map's attribute order, uncovered layers and
tie-break; a planted colour head named a colour head by the analysis; what the mask isolates
(within a layer, not across layers); blind attribute branches left out of the fusion.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import dear
from harness.bank import project_bank
import clip_model
from clip_model import HeadContributions
from conftest import TINY_DEEP, assert_close
from dear import DeAR, DeARError, HeadRole, RoleMap
from test_dear_reference import prompts, reference  # the reference forward, and its class prompts

ATTRIBUTES = ["texture", "colour", "shape"]
LAYERS, HEADS = TINY_DEEP["vision_layers"], TINY_DEEP["vision_heads"]
N_IMAGE = 1 + (TINY_DEEP["image_resolution"] // TINY_DEEP["vision_patch_size"]) ** 2


def role_map(spec: dict, layers=range(LAYERS), attributes=ATTRIBUTES) -> RoleMap:
    """spec: {(layer, head): "G" | "M" | attribute}; unlisted heads of listed layers are mixed."""
    heads = []
    for layer in layers:
        for head in range(HEADS):
            tag = spec.get((layer, head), "M")
            heads.append(HeadRole(layer, head, {"G": "generalization", "M": "mixed"}[tag]) if tag in ("G", "M")
                         else HeadRole(layer, head, "attribute", tag))
    return RoleMap(LAYERS, HEADS, list(attributes), heads)


MIXED_MAP = {(1, 0): "colour", (1, 1): "G", (2, 1): "shape", (2, 2): "G", (2, 3): "texture"}


def images(batch=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, TINY_DEEP["image_resolution"], TINY_DEEP["image_resolution"], generator=generator)


def make(clip, spec=MIXED_MAP, J=1, beta=0.3, K=3) -> DeAR:
    torch.manual_seed(7)
    model = DeAR(clip, role_map(spec), ATTRIBUTES, first_layer=J, beta=beta, num_text_tokens=K)
    with torch.no_grad():
        model.tokens.vision_tokens.normal_(0, 1.0)
        model.tokens.text_tokens.normal_(0, 1.0)
        model.tokens.attribute_proj.add_(torch.randn_like(model.tokens.attribute_proj) * 0.5)
        model.fusion_logits.copy_(torch.randn_like(model.fusion_logits))
    return model


# ------------------------------------------------------------------------------------------
# Training reaches what it should, and nothing else
# ------------------------------------------------------------------------------------------


def test_the_self_regularisation_alone_trains_the_vision_and_the_text_tokens(tiny_deep_clip):
    model = make(tiny_deep_clip)
    out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    reg = dear.self_regularization_loss(out.image_features[:, 0], out.frozen_image_features,
                                        out.text_features, out.frozen_text_features)
    reg.backward()
    assert model.tokens.vision_tokens.grad is not None and model.tokens.vision_tokens.grad.abs().max() > 0, \
        "L_reg does not reach the vision tokens (the adapted class feature is detached?)"
    assert model.tokens.text_tokens.grad is not None and model.tokens.text_tokens.grad.abs().max() > 0, \
        "L_reg does not reach the text tokens (the adapted text feature is detached?)"


def test_one_optimizer_step_moves_every_learnable_tensor_and_no_clip_weight(tiny_deep_clip):
    model = make(tiny_deep_clip)
    own = {name for name, p in model.named_parameters() if not name.startswith("clip.")}
    listed = {name for name, p in model.named_parameters() if any(p is q for q in model.learnable_parameters())}
    assert listed == own, f"learnable_parameters() misses {sorted(own - listed)}"
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=1e-2)
    out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    dear.dear_loss(out, torch.tensor([0, 3, 1]))["total"].backward()
    optimizer.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(p.detach(), before[name])
        if name.startswith("clip."):
            assert not moved, f"the frozen CLIP weight {name} changed"
        else:
            assert moved, f"the learnable tensor {name} did not change in one step"


# ------------------------------------------------------------------------------------------
# beta, read at the inputs of the blocks
# ------------------------------------------------------------------------------------------


def _block_inputs_and_outputs(blocks):
    seen = {}
    hooks = []
    for index, b in enumerate(blocks):
        hooks.append(b.register_forward_pre_hook(lambda m, args, i=index: seen.__setitem__(("in", i), args[0])))
        hooks.append(b.register_forward_hook(lambda m, args, out, i=index: seen.__setitem__(("out", i), out)))
    return seen, hooks


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_tokens_entering_each_layer_follow_the_beta_rule(tiny_deep_clip, beta):
    # Tokens entering layer l > J = beta * p_l + (1 - beta) * (tokens leaving layer l - 1):
    # beta = 1 uses each layer's fresh tokens alone, beta = 0 carries layer J's tokens on.
    model = make(tiny_deep_clip, J=1, beta=beta)
    seen, hooks = _block_inputs_and_outputs(tiny_deep_clip.visual.transformer.resblocks)
    with torch.no_grad():
        model.encode_image(images())
    tseen, thooks = _block_inputs_and_outputs(tiny_deep_clip.transformer.resblocks)
    with torch.no_grad():
        model.encode_text(model.prepare_classes(prompts()))
    for hook in hooks + thooks:
        hook.remove()
    A, K = len(ATTRIBUTES), 3
    assert_close(seen[("in", 0)][:, N_IMAGE:], model.tokens.vision_tokens[0].expand(3, A, -1), 1e-6, "vision, layer J")
    for layer in range(1, LAYERS):
        expected = beta * model.tokens.vision_tokens[layer] + (1 - beta) * seen[("out", layer - 1)][:, N_IMAGE:]
        assert_close(seen[("in", layer)][:, N_IMAGE:], expected, 1e-6, f"vision tokens entering layer {layer}")
        assert_close(seen[("in", layer)][:, :N_IMAGE], seen[("out", layer - 1)][:, :N_IMAGE], 0, "image tokens")
    assert_close(tseen[("in", 0)][:, 1:1 + K], model.tokens.text_tokens[0].expand(4, K, -1), 1e-6, "text, layer J")
    for layer in range(1, TINY_DEEP["transformer_layers"]):
        expected = beta * model.tokens.text_tokens[layer] + (1 - beta) * tseen[("out", layer - 1)][:, 1:1 + K]
        assert_close(tseen[("in", layer)][:, 1:1 + K], expected, 1e-6, f"text tokens entering layer {layer}")
        assert torch.equal(tseen[("in", layer)][:, 0], tseen[("out", layer - 1)][:, 0]), "start token moved"


def test_at_beta_zero_only_layer_js_tokens_matter(tiny_deep_clip):
    model = make(tiny_deep_clip, J=1, beta=0.0)
    out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    dear.dear_loss(out, torch.tensor([0, 3, 1]))["total"].backward()
    assert model.tokens.vision_tokens.grad[0].abs().max() > 0 and model.tokens.text_tokens.grad[0].abs().max() > 0
    assert model.tokens.vision_tokens.grad[1:].abs().max() == 0 and model.tokens.text_tokens.grad[1:].abs().max() == 0


# ------------------------------------------------------------------------------------------
# The text side
# ------------------------------------------------------------------------------------------


def test_two_class_lists_of_the_same_shape_get_their_own_text_features(tiny_deep_clip):
    # Base and novel class lists often have the same shape: each prepared list must give its
    # own features, whatever was prepared last (nothing keyed by shape, nothing kept inside).
    model = make(tiny_deep_clip, J=2)
    base, novel = prompts(4, seed=0), prompts(4, seed=5)
    assert base.shape == novel.shape and not torch.equal(base, novel)
    with torch.no_grad():
        prepared_base = model.prepare_classes(base)
        prepared_novel = model.prepare_classes(novel)
        t_base, t_novel = model.encode_text(prepared_base), model.encode_text(prepared_novel)
        tensors = {name: t.detach() for name, t in model.learnable_state_dict().items()}
        for ids, t, prepared, name in ((base, t_base, prepared_base, "base"), (novel, t_novel, prepared_novel, "novel")):
            ref = reference(tiny_deep_clip, tensors, 2, images(), ids)  # computes the text from scratch
            assert_close(t, ref["text"], 1e-5, f"{name} list's text features")
            assert_close(prepared.frozen, ref["frozen_text"], 1e-5, f"{name} list's frozen text features")
    assert (t_base - t_novel).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------
# TextSpan
# ------------------------------------------------------------------------------------------


def _planted(n=300, E=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    bank = F.normalize(torch.randn(200, E, generator=generator), dim=-1)
    data = sum(s * torch.randn(n, 1, generator=generator) * bank[p] for s, p in ((5.0, 17), (3.0, 123), (1.5, 5)))
    data = data + 0.6 * torch.randn(n, 1, generator=generator) * bank[42]  # a weaker, fourth direction
    return bank, data + 0.01 * torch.randn(n, E, generator=generator)


def test_textspan_keeps_the_top_rank_directions_of_the_raw_contributions_mean_included():
    bank, data = _planted()  # E = 64 > rank = 3
    data = data + 8.0 * bank[99]  # every image shares a large offset: no variance, but a direction
    assert dear.textspan(data, bank, num_descriptions=4, rank=80) == [17, 123, 5, 42]
    # The raw contributions' top 3 directions are the offset, 17 and 123 (centred first they
    # would be 17, 123, 5): with rank 3 the third pick cannot be 5.
    truncated = dear.textspan(data, bank, num_descriptions=3, rank=3)
    assert truncated[:2] == [17, 123] and truncated[2] != 5, "the span was taken after centring, or the rank ignored"
    with pytest.raises(DeARError, match=r"1\.\.3 picks .*TextSpan keeps 3 singular directions"):
        dear.textspan(data, bank, num_descriptions=4, rank=3)  # a 4th pick would be noise


def test_textspan_removes_each_chosen_direction_from_the_bank():
    # Without the removal, taking out the 2nd pick's raw direction (which leans on the 1st)
    # puts some of the 1st direction back into the data, and a text along it (index 4)
    # wins the 3rd pick instead of the true third direction (index 3).
    e = torch.eye(16)
    bank = F.normalize(torch.stack([e[0], e[0] + e[1], e[0] + e[1] + 0.05 * e[7], e[2], e[0] + 0.3 * e[6]]), dim=-1)
    generator = torch.Generator().manual_seed(0)
    coefficients = torch.randn(400, 3, generator=generator)
    data = coefficients @ (torch.tensor([5.0, 3.0, 1.0])[:, None] * e[:3])  # (400, 16)
    data = data + 0.01 * torch.randn(400, 16, generator=generator)
    assert dear.textspan(data, bank, num_descriptions=3, rank=80) == [0, 1, 3]



def test_textspan_steps_give_each_picks_share_of_the_heads_variance():
    """The walkthrough's numbers: each pick's share is the variance along its direction, taken out
    in turn, so the planted strengths come back (5, 3, 1.5 and 0.6 squared, over their sum)."""
    bank, data = _planted()
    steps = list(dear.textspan_steps(data, bank, num_descriptions=4, rank=80))
    assert [pick for pick, _ in steps] == dear.textspan(data, bank, num_descriptions=4, rank=80)
    strengths = torch.tensor([5.0, 3.0, 1.5, 0.6]) ** 2
    sample = data - data.mean(0)
    for (pick, share), planted in zip(steps, strengths / strengths.sum()):
        assert abs(share - float(planted)) < 0.06, (pick, share, float(planted))
    assert 0.97 < sum(share for _, share in steps) <= 1.0  # the noise is the rest
    first = F.normalize(bank[17], dim=0)  # the whole head's variance along the first pick, alone
    assert steps[0][1] == pytest.approx(float((sample @ first).pow(2).sum() / sample.pow(2).sum()), rel=1e-3)

# ------------------------------------------------------------------------------------------
# Role maps: attribute order, uncovered layers, ties
# ------------------------------------------------------------------------------------------


def test_the_role_maps_own_attribute_order_picks_the_token(tiny_deep_clip):
    order = ["shape", "colour"]  # not the core order (colour first)
    roles = role_map({(2, 0): "colour", (2, 1): "G", (2, 2): "G", (2, 3): "G"}, layers=[2], attributes=order)
    masks = dear.build_role_masks(roles, 3, LAYERS, N_IMAGE)  # (1, H, T, T)
    colour, shape = N_IMAGE + order.index("colour"), N_IMAGE + order.index("shape")
    assert (masks[0, 0, :N_IMAGE, colour] == 0).all() and (masks[0, 0, colour, :N_IMAGE] == 0).all()
    assert (masks[0, 0, :N_IMAGE, shape] == float("-inf")).all()


def test_layers_the_map_does_not_cover_are_mixed(tiny_deep_clip):
    roles = role_map({(2, h): "G" for h in range(HEADS)}, layers=[2])
    masks = dear.build_role_masks(roles, 1, LAYERS, N_IMAGE)  # layers 0 and 1 not covered
    assert (masks[:2] == 0).all(), "an uncovered layer is not mixed"
    assert (masks[2] == float("-inf")).any()


def test_a_concept_tie_goes_to_the_concept_found_first_not_last():
    assert dear.dominant_concept(["shape", "colour", "shape", "colour"]) == "shape"
    assert dear.dominant_concept(["colour", "shape", "colour", "shape"]) == "colour"
    dominants = [dear.dominant_concept(c) for c in [["shape", "colour", "shape", "colour"], ["object"], ["x"]]]
    roles = dear.assign_roles([0.0, 1.0, 2.0], dominants, ["colour", "shape"], low_bits=1.0, high_bits=1.5)
    assert roles[0] == ("attribute", "shape")


# ------------------------------------------------------------------------------------------
# The head analysis finds a planted colour head
# ------------------------------------------------------------------------------------------


def test_a_head_writing_along_colour_descriptions_is_named_a_colour_head(tiny_deep_clip, monkeypatch):
    bank = project_bank()
    E, L, n = 48, 2, 120
    generator = torch.Generator().manual_seed(0)
    text = F.normalize(torch.randn(len(bank), E, generator=generator), dim=-1)  # a fake text encoder
    colour = torch.tensor([d.concept == "colour" for d in bank])

    def fake_contributions(clip, batch, num_layers):
        B = batch.shape[0]
        g = torch.Generator().manual_seed(int(batch.sum().abs().item() * 1000) % 10_000)
        heads = torch.randn(B, L, HEADS, E, generator=g) * 0.3  # unstructured heads
        weights = torch.randn(B, 6, generator=g) * torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.8])
        heads[:, 1, 2] = weights @ text[colour][::7][:6]  # layer 2 of 2, head 2: six colour directions
        return HeadContributions(heads, torch.zeros(B, L, E), torch.randn(B, E, generator=g) + 3.0,
                                 torch.zeros(E), tuple(range(LAYERS - L, LAYERS)))

    monkeypatch.setattr(dear.clip_model, "head_contributions", fake_contributions)
    monkeypatch.setattr(dear, "encode_descriptions", lambda clip, tokenizer, texts: text)
    seen, textspan = [], dear.textspan
    monkeypatch.setattr(dear, "textspan", lambda data, *rest: seen.append(data) or textspan(data, *rest))
    batches = [images(40, seed=s) for s in range(3)]
    result = dear.analyze_heads(tiny_deep_clip, batches, tokenizer=None, bank=bank, num_layers=L,
                                num_descriptions=6, rank=20, log=lambda line: None)
    # TextSpan reads each contribution divided by the norm of its image's full embedding.
    parts = [fake_contributions(None, batch, L) for batch in batches]
    expected = torch.cat([p.heads[:, 0, 0] / p.total().norm(dim=-1, keepdim=True) for p in parts])
    assert_close(seen[0], expected, 1e-6, "contributions handed to TextSpan")
    planted = result.role_of(LAYERS - 1, 2)
    assert planted.concepts == ["colour"] * 6 and planted.entropy == 0.0
    assert (planted.role, planted.attribute) == ("attribute", "colour")
    others = [h for h in result.heads if (h.layer, h.head) != (LAYERS - 1, 2)]
    assert all(h.entropy > 0 for h in others)
    # The thresholds: 6 picks over the bank's 12 labels (not the few the heads name); one given,
    # the other still the rule's.
    assert (result.low_bits, result.high_bits) == pytest.approx(dear.default_thresholds(6, 12))
    given = dear.analyze_heads(tiny_deep_clip, batches, tokenizer=None, bank=bank, num_layers=L,
                               num_descriptions=6, rank=20, low_bits=0.25, log=lambda line: None)
    assert (given.low_bits, given.high_bits) == pytest.approx((0.25, dear.default_thresholds(6, 12)[1]))


# ------------------------------------------------------------------------------------------
# What the mask isolates, and branches that cannot see the image
# ------------------------------------------------------------------------------------------


def test_isolation_holds_within_a_layer_not_across_layers(tiny_deep_clip):
    # Layer 2 (1-based) is all mixed, layer 3 all generalization, J = 2.
    model = make(tiny_deep_clip, {**{(2, h): "G" for h in range(HEADS)}}, J=2)
    blocks = tiny_deep_clip.visual.transformer.resblocks
    # Within layer 3: its generalization heads' outputs at the image tokens do not depend on
    # the attribute tokens entering that layer.
    x = torch.randn(2, N_IMAGE, TINY_DEEP["vision_width"])
    tokens = torch.randn(2, len(ATTRIBUTES), TINY_DEEP["vision_width"], requires_grad=True)
    _, details = blocks[2].attn(blocks[2].ln_1(torch.cat([x, tokens], 1)), model.role_masks[1], return_details=True)
    (grad,) = torch.autograd.grad(details.head_outputs[:, :, :N_IMAGE].sum(), tokens)
    assert grad.abs().max() == 0
    # Across layers: the class feature still depends on the attribute tokens, which the mixed
    # heads of layer 2 wrote into the image tokens that layer 3's heads read.
    f_cls, _, _ = model.encode_image(images())
    f_cls.square().sum().backward()
    assert model.tokens.vision_tokens.grad[0].abs().max() > 0
    assert model.tokens.vision_tokens.grad[1].abs().max() == 0  # layer 3's own tokens: no way in


def test_a_branch_that_cannot_read_the_image_is_left_out_of_the_fusion(tiny_deep_clip):
    # From J = 3: head 0 is a colour head, the rest generalization: texture and shape are blind.
    spec = {(2, 0): "colour", (2, 1): "G", (2, 2): "G", (2, 3): "G"}
    with pytest.warns(UserWarning, match=r"texture, shape tokens read the image; left out of the fusion"):
        model = make(tiny_deep_clip, spec, J=3)
    assert model.blind_attributes == ["texture", "shape"]
    alpha = model.fusion_weights()
    assert alpha[0] > 0 and alpha[2] > 0 and alpha[1] == 0 and alpha[3] == 0
    assert alpha.sum().item() == pytest.approx(1.0)
    out = model(images(), model.prepare_classes(prompts()))
    assert_close(out.logits, alpha[0] * out.branch_logits[:, 0] + alpha[2] * out.branch_logits[:, 2], 1e-5, "fusion")
    # All generalization: every attribute branch is blind; the class branch stands alone.
    with pytest.warns(UserWarning, match="texture, colour, shape"):
        alone = make(tiny_deep_clip, {(l, h): "G" for l in range(LAYERS) for h in range(HEADS)}, J=1)
    assert alone.fusion_weights().tolist() == [1.0, 0.0, 0.0, 0.0]
    out = alone(images(), alone.prepare_classes(prompts()))
    assert torch.equal(out.logits, out.branch_logits[:, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when every branch can see
        make(tiny_deep_clip, MIXED_MAP, J=1)


# ------------------------------------------------------------------------------------------
# Defaults and checks that a wrong analysis would slip past
# ------------------------------------------------------------------------------------------


def test_the_analysis_looks_at_the_last_four_layers_by_default(monkeypatch):
    torch.manual_seed(0)
    five = clip_model.CLIP(**dict(TINY_DEEP, vision_layers=5)).eval()  # deeper than four
    bank = project_bank()
    generator = torch.Generator().manual_seed(1)
    texts = F.normalize(torch.randn(len(bank), TINY_DEEP["embed_dim"], generator=generator), dim=-1)
    monkeypatch.setattr(dear, "encode_descriptions", lambda clip, tokenizer, phrases: texts)
    roles = dear.analyze_heads(five, images(8), None, bank, num_descriptions=6, log=lambda line: None)
    assert roles.layers == [1, 2, 3, 4]  # 0-based: the paper's layers 2-5 of 5
    assert roles.layers[0] == dear.default_first_layer(len(five.visual.transformer.resblocks)) - 1  # where J starts by default
    assert len(roles.heads) == 4 * HEADS


def test_role_thresholds_are_thirds_of_the_possible_spread_and_a_head_on_one_takes_its_side():
    # 8 picks over 12 concepts can spread over at most log2(8) = 3 bits: the thresholds are
    # exactly 1 and 2 bits, whatever the heads' own entropies (their thirds would be other
    # numbers), and four heads sit exactly on a threshold: on the low one a specialist, on
    # the high one generalization.
    entropies = [0.0, 0.2, 0.5, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 2.5, 3.0, 3.0]
    concepts = [["colour"] * 8] * 5 + [["shape"] * 8] * 7
    low, high = dear.default_thresholds(8, 12)
    assert (low, high) == (1.0, 2.0)
    roles = dear.assign_roles(entropies, [dear.dominant_concept(c) for c in concepts], ATTRIBUTES, low, high)
    assert roles == [("attribute", "colour")] * 5 + [("mixed", None)] * 2 + [("generalization", None)] * 5
    # Fewer concepts than picks: the spread is bounded by the concepts, log2(4) = 2 bits; low is not
    # a third of it (0.67) but 3 of 4 picks on one concept (0.81 bits), the least a specialist needs.
    assert dear.default_thresholds(8, 4) == pytest.approx((0.811278, 4 / 3))


def test_the_fusion_starts_at_cls_fusion_weight_and_shares_the_rest_evenly(tiny_deep_clip):
    model = DeAR(tiny_deep_clip, role_map(MIXED_MAP), ATTRIBUTES, first_layer=1, cls_fusion_weight=0.7)
    assert model.blind_attributes == []
    assert_close(model.fusion_weights(), torch.tensor([0.7, 0.1, 0.1, 0.1]), 1e-6, "initial fusion weights")


def test_the_attribute_projection_starts_as_a_copy_of_clips_proj(tiny_deep_clip):
    model = DeAR(tiny_deep_clip, role_map(MIXED_MAP), ATTRIBUTES, first_layer=1)
    proj = tiny_deep_clip.visual.proj
    assert torch.equal(model.tokens.attribute_proj, proj) and model.tokens.attribute_proj.data_ptr() != proj.data_ptr()
    with torch.no_grad():
        model.tokens.attribute_proj.add_(1.0)
    assert not torch.equal(model.tokens.attribute_proj, proj)  # training it leaves CLIP's own alone


def test_a_role_map_with_a_head_of_a_layer_missing_or_twice_is_refused():
    complete = role_map({}, layers=[2])
    complete.validate(LAYERS, HEADS)
    missing = RoleMap(LAYERS, HEADS, ATTRIBUTES, [h for h in complete.heads if h.head != 2])
    with pytest.raises(DeARError, match=r"layer 3 \(index 2\) lists heads \[0, 1, 3\], expected each of 0..3 once"):
        missing.validate(LAYERS, HEADS)
    twice = RoleMap(LAYERS, HEADS, ATTRIBUTES, complete.heads + [HeadRole(2, 1, "mixed")])
    with pytest.raises(DeARError, match=r"lists heads \[0, 1, 1, 2, 3\]"):
        twice.validate(LAYERS, HEADS)


def test_a_branch_is_blind_only_if_no_layer_from_J_on_lets_it_read_the_image(tiny_deep_clip):
    # J = 2: at layer J only a shape head reads the image, at the last layer only a colour
    # head; texture is blind everywhere. Reading layer J alone (or the last alone) is wrong.
    spec = {(1, 0): "shape", (1, 1): "G", (1, 2): "G", (1, 3): "G",
            (2, 0): "colour", (2, 1): "G", (2, 2): "G", (2, 3): "G"}
    with pytest.warns(UserWarning, match=r"lets the texture token read the image"):
        model = DeAR(tiny_deep_clip, role_map(spec), ATTRIBUTES, first_layer=2)
    assert model.blind_attributes == ["texture"]
    assert model.fusion_weights()[[0, 2, 3]].gt(0).all() and model.fusion_weights()[1] == 0


# ------------------------------------------------------------------------------------------
# The paper's ablations, as dear.py builds them (train.py --ablations)
# ------------------------------------------------------------------------------------------


def test_without_attribute_tokens_the_image_side_is_frozen_clip_and_the_logits_the_class_branchs(
        tiny_deep_clip):
    no_tokens = RoleMap.uniform("mixed", LAYERS, HEADS, range(LAYERS), attributes=[])
    torch.manual_seed(3)
    model = DeAR(tiny_deep_clip, no_tokens, attributes=[], first_layer=1, beta=0.3,
                 num_text_tokens=3)
    with torch.no_grad():
        model.tokens.text_tokens.normal_(0, 1.0)
        model.fusion_logits.normal_(0, 1.0)
    labels = torch.tensor([0, 3, 1])
    out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    assert out.branch_logits.shape[1] == 1 and out.alpha.tolist() == [1.0]  # one branch, all weight
    assert torch.equal(out.logits, out.branch_logits[:, 0])
    assert_close(out.image_features[:, 0], out.frozen_image_features, 1e-5, "class vs plain CLIP")
    assert (out.text_features - out.frozen_text_features).abs().max() > 1e-3  # the text tokens act
    losses = dear.dear_loss(out, labels, lambda_fusion=0.5, branch_ce=True)
    assert losses["fusion"].item() == 0.0  # -log(alpha_cls) = -log(1)
    class_ce = F.cross_entropy(out.branch_logits[:, 0], labels)
    assert_close(losses["branch"], class_ce, 1e-6, "a class branch alone: its own per-branch CE")
    losses["total"].backward()
    assert model.tokens.text_tokens.grad.abs().max() > 0 and model.tokens.vision_tokens.numel() == 0


def test_the_mask_on_generalization_heads_only_makes_each_attribute_head_mixed(tiny_deep_clip):
    measured = role_map(MIXED_MAP)
    for head in measured.heads:  # measured (entropies): without attribute heads it would fall back
        head.entropy = 0.5 if head.role == "attribute" else 2.0
        head.descriptions, head.concepts = [f"{head.role} {head.head}"], [f"cluster {head.layer}"]
    measured.low_bits, measured.high_bits, measured.concepts = 0.81, 1.33, "clusters"
    measured.clusters = [dear.Cluster(1, "colour", 4, ["red"])]
    roles_before = [(h.role, h.attribute) for h in measured.heads]
    ablated = dear.generalization_mask_only(measured)
    expected = [{"attribute": "mixed"}.get(h.role, h.role) for h in measured.heads]
    assert [h.role for h in ablated.heads] == expected
    assert not any(h.attribute for h in ablated.heads)
    # Only the roles and the source change: what was measured stays, the measured map untouched.
    assert ablated.source == "analysis; attribute heads made mixed"
    kept = ("vision_layers", "num_heads", "attributes", "low_bits", "high_bits", "concepts", "clusters")
    assert [getattr(ablated, f) for f in kept] == [getattr(measured, f) for f in kept]
    per_head = lambda m: [(h.layer, h.head, h.entropy, h.descriptions, h.concepts) for h in m.heads]  # noqa: E731
    assert per_head(ablated) == per_head(measured)
    assert [(h.role, h.attribute) for h in measured.heads] == roles_before
    before = make(tiny_deep_clip, MIXED_MAP)
    assert DeAR(tiny_deep_clip, ablated, ATTRIBUTES, first_layer=1).class_branch_only  # measured
    after = DeAR(tiny_deep_clip, ablated, ATTRIBUTES, first_layer=1, class_branch_fallback=False)
    assert not after.class_branch_only and after.blind_attributes == []  # all read, none falls back
    for layer, head in [(1, 1), (2, 2)]:  # the generalization heads keep their mask ...
        assert torch.equal(after.role_masks[layer, head], before.role_masks[layer, head])
        assert not torch.isfinite(after.role_masks[layer, head]).all()
    for layer, head in [(1, 0), (2, 1), (2, 3)]:  # ... the attribute heads have none
        assert torch.isfinite(after.role_masks[layer, head]).all()


def test_ablate_is_the_one_path_of_every_ablation_and_refuses_an_unknown_name(tiny_deep_clip):
    """Each ablation's DeAR, built from what ablate returns, is the row with its one change."""
    measured = role_map(MIXED_MAP)
    for head in measured.heads:
        head.entropy = 0.5 if head.role == "attribute" else 2.0

    def built(name):
        change = dear.ablate(name, measured, ATTRIBUTES, 0.1)
        return change, DeAR(tiny_deep_clip, change.role_map, change.attributes, first_layer=1,
                            num_text_tokens=2, class_branch_fallback=change.class_branch_fallback)

    plain, row = built(None)
    assert plain == (measured, ATTRIBUTES, True, 0.1, False, 1.0, "logits", None)
    assert (row.role_masks != 0).any()
    no_mask, model = built("no-role-mask")
    assert (model.role_masks == 0).all() and model.attributes == ATTRIBUTES  # every head mixed
    assert no_mask.role_map.layers == measured.layers and no_mask.role_map.source == "all-mixed"
    _, model = built("no-attribute-tokens")
    assert model.attributes == [] and model.role_masks.shape[-1] == N_IMAGE
    _, model = built("mask-generalization-only")
    assert not model.class_branch_only and model.in_fusion.all()  # no fallback, every branch in
    assert built("no-fusion-reg")[0].lambda_fusion == 0.0 and built("branch-ce")[0].branch_ce
    with pytest.raises(DeARError, match="ablation 'no-mask': use one of no-role-mask, no-attribute"):
        dear.ablate("no-mask", measured, ATTRIBUTES, 0.1)


def test_branch_ce_adds_mmrls_per_branch_cross_entropy_of_the_branches_in_the_fusion(
        tiny_deep_clip):
    spec = {(2, 0): "colour", (2, 1): "G", (2, 2): "G", (2, 3): "shape"}  # J = 3: texture blind
    with pytest.warns(UserWarning, match="texture token"):
        model = make(tiny_deep_clip, spec, J=3)
    labels = torch.tensor([0, 3, 1])
    out = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    paper, ours = dear.dear_loss(out, labels), dear.dear_loss(out, labels, branch_ce=True)
    assert "branch" not in paper  # the paper's loss is the default
    ce = [F.cross_entropy(out.branch_logits[:, k], labels) for k in range(4)]
    by_hand = 0.7 * ce[0] + 0.3 * (ce[2] + ce[3]) / 2  # MMRL's ALPHA; the colour and shape branches
    assert_close(ours["branch"], by_hand, 1e-5, "per-branch CE")
    assert_close(ours["total"], paper["total"] + by_hand, 1e-5, "total")
    assert (ce[1] - (ce[2] + ce[3]) / 2).abs() > 1e-3  # a blind branch counted in would show


# ------------------------------------------------------------------------------------------
# The lab's controls (dear.ablate): each keeps what its question holds fixed
# ------------------------------------------------------------------------------------------
def measured_map(spec=MIXED_MAP) -> RoleMap:
    measured = role_map(spec)
    for head in measured.heads:
        head.entropy = 0.5 if head.role == "attribute" else 2.0
    return measured


def roles_of(m: RoleMap) -> list:
    return [(h.layer, h.head, h.role, h.attribute) for h in m.heads]


def test_shuffled_heads_keeps_every_role_and_attribute_count_and_moves_them_by_the_seed():
    measured = measured_map()
    counts = lambda m: sorted((h.role, str(h.attribute)) for h in m.heads)  # noqa: E731
    shuffled = {seed: dear.ablate("shuffled-heads", measured, ATTRIBUTES, 0.1, seed=seed).role_map
                for seed in (1, 2, 3)}
    for seed, m in shuffled.items():
        assert counts(m) == counts(measured)  # the same roles, the same attributes, as often
        assert [(h.layer, h.head) for h in m.heads] == [(h.layer, h.head) for h in measured.heads]
        assert roles_of(m) == roles_of(dear.shuffled_heads(measured, seed))  # the seed's alone
    assert all(roles_of(m) != roles_of(measured) for m in shuffled.values())  # heads moved
    assert roles_of(shuffled[1]) != roles_of(shuffled[2])  # several shuffles, one per seed


def opening(count: int) -> dict:
    """A map spec with `count` heads mixed (the first ones), every other head generalization."""
    heads = [(layer, head) for layer in range(LAYERS) for head in range(HEADS)]
    return {place: "G" for place in heads[count:]}


@pytest.mark.parametrize("spec", [MIXED_MAP, {}, opening(1), opening(5), opening(7)])
def test_whole_layers_opens_whole_top_layers_as_many_heads_as_the_map_opens(spec):
    measured = measured_map(spec)
    opened = sum(h.role != "generalization" for h in measured.heads)
    layers = dear.ablate("whole-layers", measured, ATTRIBUTES, 0.1).role_map
    by_layer = {layer: {h.role for h in layers.heads if h.layer == layer} for layer in layers.layers}
    assert all(roles in ({"mixed"}, {"generalization"}) for roles in by_layer.values())  # whole
    open_layers = [layer for layer, roles in by_layer.items() if roles == {"mixed"}]
    assert open_layers == measured.layers[len(measured.layers) - len(open_layers):]  # the top
    assert abs(len(open_layers) * HEADS - opened) <= HEADS / 2  # rounded to the nearest layer
    assert layers.attributes == measured.attributes


def test_true_heads_are_exactly_the_heads_the_causal_check_singles_out():
    from toyworld import causal

    measured = measured_map()
    singled = {(0, 1): "shape", (2, 0): "colour", (2, 3): "colour"}
    result = {"heads": [{"layer": h.layer, "head": h.head, "singled_out": singled.get((h.layer, h.head))}
                        for h in measured.heads]}
    true_map = causal.true_role_map(result, measured)
    change = dear.ablate("true-heads", measured, ATTRIBUTES, 0.1, true_map=true_map)
    assert {(h.layer, h.head): h.attribute for h in change.role_map.heads
            if h.role == "attribute"} == singled
    assert {h.role for h in change.role_map.heads if (h.layer, h.head) not in singled} == {
        "generalization"}
    with pytest.raises(DeARError, match="ablation 'true-heads' needs true_map"):
        dear.ablate("true-heads", measured, ATTRIBUTES, 0.1)


def test_fixed_fusion_holds_alpha_at_mmrls_weight_through_training(tiny_deep_clip):
    change = dear.ablate("fixed-fusion", measured_map(), ATTRIBUTES, 0.1)
    torch.manual_seed(0)
    model = DeAR(tiny_deep_clip, change.role_map, change.attributes, first_layer=1,
                 num_text_tokens=2, fixed_alpha=change.fixed_alpha)
    before = model.fusion_weights().detach().clone()
    assert before.tolist() == pytest.approx([dear.MMRL_ALPHA] + [0.1] * 3)  # the rest even
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=0.1)
    classes = model.prepare_classes(prompts())
    for _ in range(2):
        output = model(images(), classes, with_frozen=True)
        losses = dear.dear_loss(output, torch.tensor([0, 1, 2]), 1.0, change.lambda_fusion)
        optimizer.zero_grad()
        losses["total"].backward()
        optimizer.step()
    assert torch.equal(model.fusion_weights(), before)
    assert "fusion_logits" not in model.learnable_state_dict()  # nothing of it to keep


def test_feature_fusion_equals_logit_fusion_when_every_branch_has_the_same_feature(tiny_deep_clip):
    change = dear.ablate("feature-fusion", measured_map(), ATTRIBUTES, 0.1)
    models = [DeAR(tiny_deep_clip, change.role_map, change.attributes, first_layer=1,
                   num_text_tokens=2, fuse=fuse) for fuse in ("logits", change.fuse)]
    with torch.no_grad():
        for model in models:
            model.fusion_logits.copy_(torch.tensor([0.3, -1.0, 0.5, 2.0]))
    generator = torch.Generator().manual_seed(0)
    text, feature = torch.randn(5, 32, generator=generator), torch.randn(3, 1, 32, generator=generator)
    same = feature.expand(3, 4, 32) * torch.tensor([1.0, 2.0, 0.5, 3.0])[:, None]  # lengths apart
    by_logits, by_features = (model.fused_logits(same, text)[0] for model in models)
    assert_close(by_features, by_logits, atol=1e-4)
    apart = torch.randn(3, 4, 32, generator=generator)  # otherwise s cos(sum_k alpha_k f_k/|f_k|, t)
    fused = torch.einsum("bae,a->be", F.normalize(apart, dim=-1), models[1].fusion_weights())
    scale = tiny_deep_clip.logit_scale.exp()
    assert_close(models[1].fused_logits(apart, text)[0], scale * F.normalize(fused, dim=-1)
                 @ F.normalize(text, dim=-1).T, atol=1e-4)
    assert not torch.allclose(models[0].fused_logits(apart, text)[0], models[1].fused_logits(apart, text)[0])


def test_no_self_reg_leaves_no_regularisation_term_in_the_loss(tiny_deep_clip):
    model = make(tiny_deep_clip)
    output = model(images(), model.prepare_classes(prompts()), with_frozen=True)
    labels = torch.tensor([0, 1, 2])
    for name in (None, "no-self-reg"):
        change = dear.ablate(name, measured_map(), ATTRIBUTES, 0.1)
        losses = dear.dear_loss(output, labels, change.lambda_reg, change.lambda_fusion)
        terms = losses["ce"] + 0.1 * losses["fusion"] + (0 if name else losses["reg"])
        assert float(losses["reg"]) > 1e-3  # a term there would show
        assert float(losses["total"]) == pytest.approx(float(terms), abs=1e-6)
