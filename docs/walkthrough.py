"""
docs/walkthrough.py -- DeAR one step at a time on the toy world's CLIP: eleven steps, each
calling the library (clip_model.py, dear.py, data.py, train.py), printing what it made and
asserting the invariant it shows. Run it and read what it prints; then read dear.py top to bottom.

    python docs/walkthrough.py                  # about 85 CPU-seconds, one thread; no download
    python docs/walkthrough.py --output DIR     # the page and its pictures in DIR, not docs/

It writes docs/walkthrough.md, the page a reader sees on the repository's site: each step's code,
what it printed and its pictures (docs/walkthrough/*.png). Each `# %%` line starts a cell: VS Code
runs the cells one at a time (Jupyter too, with jupytext). A script, not a notebook: it runs
without Jupyter, its diffs read as code, and the page it writes is plain Markdown (the page's
machinery: docs/walkthrough_page.py). tests/test_walkthrough.py runs it, so a step whose
invariant breaks fails the tests.

Shapes, the project's letters (dear.py's header): B images in a batch; n images of a list; N
image tokens (1 + G*G); L_a the analysed layers; H heads; D a head's width; E the joint
embedding's width; W a tower's width; T descriptions in the bank; P distinct picks; A attribute
tokens; K text tokens; C classes; M the retrieval gallery's images.
"""

# %% Setup: the toy world's CLIP, its tokenizer, description bank and task, on one CPU thread
# A small CLIP trained on the toy world's pictures (shipped, no download), its tokenizer, the
# labelled bank TextSpan picks from, the attributes that get a token each, and the task: 12 base
# classes to train on, 12 novel ones to test. show, step, picture: what each step prints and
# draws, also kept for the page (docs/walkthrough_page.py).
import json
import os
import sys
import tempfile
import warnings
from collections import Counter
from contextlib import redirect_stdout
from io import StringIO

HERE = os.path.dirname(os.path.abspath(globals().get("__file__", "docs/walkthrough.py")))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository and docs/: run from anywhere

import torch  # noqa: E402

import clip_model  # noqa: E402
import data  # noqa: E402
import dear  # noqa: E402
import toyworld  # noqa: E402
import train  # noqa: E402
from harness import pictures, probes  # noqa: E402
from toyworld.causal import causal_check  # noqa: E402
from toyworld.task import split_scenes  # noqa: E402
from walkthrough_page import picture, show, step  # noqa: E402

step(0)
torch.manual_seed(0)
torch.set_num_threads(toyworld.THREADS)  # the toy computes on one thread (toyworld/__init__.py)
assets = toyworld.prepare("full", log=lambda line: None)  # shipped model; the task, in the cache
clip, _ = clip_model.load(assets.weights, head_width=assets.head_width)
tokenizer = clip_model.SimpleTokenizer(assets.bpe)
bank = [dear.Description(*entry) for entry in assets.bank]  # (text, concept, value): labelled
attributes = assets.attributes  # the toy's core attributes, one token each
base = data.load_dataset("toyworld", assets.data_root, subsample="base")
novel = data.load_dataset("toyworld", assets.data_root, subsample="novel")
R = clip.visual.input_resolution


def load_images(items) -> torch.Tensor:
    """Items -> (n, 3, R, R), CLIP's test transform (what train.py's evaluation reads)."""
    transform = data.test_transform(R)
    return torch.stack([transform(data.load_image(item.path)) for item in items])


# The head analysis reads the base classes' training images, as train.py does (its pool).
analysis_items = dear.analysis_images(base.train, cap=2000)  # seed dear.ANALYSIS_SEED
images = load_images(analysis_items)  # (n, 3, R, R)
show(f"toy CLIP: {sum(p.numel() for p in clip.parameters()):,} parameters, {R} px; "
      f"{len(base.classnames)} base and {len(novel.classnames)} novel classes; "
      f"{len(images)} analysis images")

# %% Step 1. An image's embedding is a sum, one term per head
# CLIP's image embedding is a sum of what each part of the network writes into the class token's
# residual stream. clip_model.head_contributions splits it: every head of the last L_a layers
# (with its share of the output bias), the MLPs of those layers, everything before them, and
# ln_post's bias, each carried through ln_post's scale and the projection (TextSpan's
# decomposition, paper Sec. 3.2). The head analysis reads only the heads' terms.
step(1)
L_a = dear.analysed_layers(len(clip.visual.transformer.resblocks))  # the last four layers
parts = clip_model.head_contributions(clip, images[:1], num_layers=L_a)
for name in ("heads", "mlps", "rest", "bias"):
    show(f"{name:>5}: {tuple(getattr(parts, name).shape)}")
embedding = clip.encode_image(images[:1])  # (1, E)
gap = (parts.total() - embedding).abs().max().item()
show(f"sum of every term vs encode_image: largest difference {gap:.1e} "
     f"(embedding norm {embedding.norm():.2f})")
share = parts.heads.norm(dim=-1)[0] / embedding.norm()  # (L_a, H): each head's share of the norm
show(f"largest head term: {share.max():.2f} of the embedding's norm (layer "
     f"{int(share.argmax()) // share.shape[1] + 1}, head {int(share.argmax()) % share.shape[1]})")
assert gap < 1e-4 * embedding.norm()  # the invariant: the terms add up to the embedding

# %% Step 2. TextSpan names what a head writes
# Over the analysis images, each head's direct contribution varies along a few directions.
# TextSpan (paper Sec. 3.2; Gandelsman et al. Alg. 1) picks, one at a time, the description of the
# bank whose direction varies most across the images, removes that direction, and picks again.
# dear.textspan_steps also gives each pick's share of the head's variance. Two heads of the last
# layer (step 4 finds their roles): head 2 and head 1.
step(2)
contributions = dear.normalised_contributions(clip, images, L_a, log=lambda line: None)
n, _, H, E = contributions.shape  # (n, L_a, H, E)
bank_embeddings = dear.encode_descriptions(clip, tokenizer, [d.text for d in bank])  # (T, E)
picks_per_head = dear.default_picks(bank, attributes)  # the fewest values of an attribute: 4
rank = dear.textspan_rank(clip)  # a head's width, D
show(f"contributions {tuple(contributions.shape)}; the bank ({len(bank)}, {E}); "
     f"{picks_per_head} picks per head, rank {rank}")
SHOWN_HEADS = [(L_a - 1, 2), (L_a - 1, 1)]  # (0-based layer, head)
for layer, head in SHOWN_HEADS:
    steps = list(dear.textspan_steps(contributions[:, layer, head], bank_embeddings,
                                     picks_per_head, rank))
    show(f"layer {layer + 1}, head {head}:")
    for pick, share in steps:
        show(f"  {share:6.1%} of the variance  {bank[pick].text!r:38} label: {bank[pick].concept}")
    assert [p for p, _ in steps] == dear.textspan(contributions[:, layer, head], bank_embeddings,
                                                  picks_per_head, rank)
    assert len({p for p, _ in steps}) == len(steps)  # a removed text is never picked again
    assert sum(s for _, s in steps) <= 1 + 1e-9  # the shares: parts of one variance

# %% Step 3. Concepts: the picks clustered, beside the bank's labels
# The paper does not know a phrase's concept: it clusters every head's distinct picks (HDBSCAN on
# their embeddings; our clustering.py) and calls each cluster a concept. The paper's pool has no
# labels; naming a cluster is the project's choice: by the label most of its phrases carry when
# the bank is labelled, else by the attribute whose name lies nearest. The toy bank is labelled,
# so the clusters can be set beside the labels. The project's default analysis reads the labels
# directly (METHOD.md Sec. 3).
step(3)
picks = [dear.textspan(contributions[:, layer, head], bank_embeddings, picks_per_head, rank)
         for layer in range(L_a) for head in range(H)]  # per head, layer-major
picked = list(dict.fromkeys(i for head_picks in picks for i in head_picks))  # (P,) distinct


def embed(texts):  # texts -> (P, E): CLIP's own text tower, the project's default encoder
    return dear.encode_descriptions(clip, tokenizer, texts)


clusters = dear.find_concepts("clusters", bank, picked, attributes, embed,
                              dear.default_min_cluster_size(picks_per_head), log=show)
for cluster in clusters.clusters:
    labels = Counter(bank[i].concept for i, c in zip(picked, clusters.of)
                     if c == f"cluster {cluster.id}")
    show(f"  cluster {cluster.id} ({cluster.name}): labels {dict(labels.most_common())}; "
         f"e.g. {cluster.central[:2]}")
labels = dear.find_concepts("labels", bank, picked, attributes, embed, 0, log=show)
show(f"labels: K = {labels.count} concepts ({', '.join(sorted(labels.names))}); "
     f"clusters: K = {clusters.count} ({len(clusters.clusters)} clusters + "
     f"{clusters.of.count(dear.NOISE)} picks in none, each its own)")
assert len(clusters.of) == len(labels.of) == len(picked)  # one concept per distinct pick
assert clusters.count == len(clusters.clusters) + clusters.of.count(dear.NOISE)
assert sum(c.size for c in clusters.clusters) + clusters.of.count(dear.NOISE) == len(picked)

# %% Step 4. Concept entropy sorts the heads into roles
# A head's concept entropy is the entropy of its picks' concepts (paper Eq. 2): 0 bits when all
# its picks share one concept. At or under the low threshold a head is a specialist: an attribute
# head if its dominant concept is a core attribute, else (a concept with no token, e.g.
# background) a generalization head; at or over the high threshold a generalization head; in
# between mixed. The thresholds (our rule, METHOD.md Sec. 3) are thirds of log2(min(N, K)) bits,
# the most N picks over K concepts can spread, with a floor: low is at least 0.81 bits, 3 of 4
# picks on one concept. On the toy (N = 4, K = 7) the thirds are 0.67 and 1.33, the floor lifts low
# to 0.81, and the three attribute heads sit on it. The toy world knows each image's attributes,
# so ablating a head shows what it really carries (toyworld/causal.py's causal_check): the claim, measured.
step(4)
role_map = dear.analyze_heads(clip, images, tokenizer, bank, attributes, num_layers=L_a,
                              log=lambda line: None)  # the labels' concepts: the default
role_map.source = "concept entropy (labels) on toyworld train (base classes)"
show(role_map.table())
low, high = dear.default_thresholds(picks_per_head, labels.count)
show(f"thresholds: low {low:.2f} bits, high {high:.2f} bits "
     f"(N = {picks_per_head} picks, K = {labels.count} concepts)")
pictures.draw_heatmap(role_map, picture("roles.png"))
check = causal_check(clip, tokenizer, role_map, attributes, log=show)
for entry in role_map.heads:  # the invariant: each role follows from its entropy alone
    assert entry.entropy == dear.concept_entropy(entry.concepts)
    (role, attribute), = dear.assign_roles([entry.entropy], [dear.dominant_concept(entry.concepts)],
                                           attributes, low, high)
    assert (entry.role, entry.attribute) == (role, attribute)
assert (role_map.low_bits, role_map.high_bits) == (low, high)
assert [role_map.role_of(*h).role for h in SHOWN_HEADS] == ["attribute", "generalization"]

# %% Step 5. The role mask: which tokens each head lets meet
# From layer J on, A attribute tokens follow the image's N tokens. Each head gets its own additive
# mask over the N + A tokens (paper Sec. 3.3): a generalization head keeps the image and the
# tokens apart, an attribute head lets its own attribute's token and the image see each other, a
# mixed head lets all meet. Printed folded: the image's N tokens as one row and column.
step(5)
depth = len(clip.visual.transformer.resblocks)
J = dear.default_first_layer(depth)  # 1-based; the first analysed layer
N = 1 + clip.visual.grid_size**2  # the class token and the patches
masks = dear.build_role_masks(role_map, J, depth, N)  # (L_v, H, N + A, N + A)
show(f"J = {J}; masks {tuple(masks.shape)}: {depth - J + 1} layers, {H} heads, "
     f"{N} image tokens + {len(attributes)} attribute tokens")
last = depth - 1  # the last layer holds a head of every role: the first of each is shown
for role in dear.ROLES:
    entry = next(h for h in role_map.heads if h.layer == last and h.role == role)
    show(f"\nlayer {last + 1}, head {entry.head}: {role} {entry.attribute or ''}".rstrip())
    show(dear.format_head_mask(masks[last - J + 1, entry.head], N, attributes))
pictures.draw_role_masks(masks[last - J + 1:], N, attributes, last + 1, picture("masks.png"),
                         role_map)
assert torch.isfinite(masks).any(dim=-1).all()  # every row keeps a 0: no softmax over nothing
for head in range(H):
    entry, mask = role_map.role_of(last, head), masks[last - J + 1, head]
    image_reads = torch.isfinite(mask[:N, N:]).all(dim=0)  # (A,): tokens the image tokens read
    reads_image = torch.isfinite(mask[N:, :N]).all(dim=1)  # (A,): tokens that read the image
    expected = {"generalization": [], "mixed": attributes, "attribute": [entry.attribute]}
    assert [a for a, r in zip(attributes, image_reads) if r] == expected[entry.role]
    assert [a for a, r in zip(attributes, reads_image) if r] == expected[entry.role]

# %% Step 6. DeAR on the role map: what learns
# DeAR freezes CLIP and adds, from layer J on, A attribute tokens in the vision tower, K text
# tokens in the text tower, the attribute tokens' projection and the fusion weights. Two token
# constructions: each layer's own tokens (ours, the default) or MMRL++'s shared latent space
# (tokens="shared": one set of latent tokens mapped into both towers).
step(6)
W_v, W_t = clip.visual.transformer.width, clip.transformer.width
L_v, L_t = depth - J + 1, len(clip.transformer.resblocks) - J + 1
A, proj = len(attributes), clip.visual.proj  # proj: (W_v, E)
frozen = sum(p.numel() for p in clip.parameters())
for construction in dear.TOKEN_CONSTRUCTIONS:
    model = dear.DeAR(clip, role_map, tokens=construction)
    counts = model.parameter_counts()
    show(f"{construction:>8}: " + " + ".join(f"{k} {v:,}" for k, v in counts.items())
         + f" = {sum(counts.values()):,} ({100 * sum(counts.values()) / frozen:.1f}% of CLIP)")
    K, Q, W_z, P_rank = model.num_text_tokens, dear.SHARED_RESIDUAL_RANK, W_t, dear.SHARED_PROJ_RANK
    expected = ({"vision_tokens": L_v * A * W_v, "text_tokens": L_t * K * W_t,
                 "attribute_proj": W_v * proj.shape[1], "fusion_logits": 1 + A}
                if construction == "separate" else
                {"latent_tokens": K * W_z,  # M, then each layer's rank-Q residual and bias
                 "vision_aligner": W_v * W_z + L_v * (W_v * Q + Q * W_z + W_v),
                 "text_aligner": W_t * W_z + L_t * (W_t * Q + Q * W_z + W_t),
                 "attribute_proj_residual": P_rank * (W_v + proj.shape[1]), "fusion_logits": 1 + A})
    assert counts == expected, (counts, expected)
    assert not any(p.requires_grad for p in clip.parameters())  # CLIP is frozen in place

# %% Step 7. The forward pass: where the tokens sit, and how the branches are fused
# DeAR's two encoders, run once on a small batch, with hooks on the frozen layers from J on
# reading what enters each layer. Image side: the A attribute tokens follow the image's N tokens
# (positions N..N+A-1), each head under its role mask. Text side: the K text tokens follow the
# start token (positions 1..K), the prompt's own tokens move K places right, and its end-of-text
# token, whose state becomes t_c, sits at eot + K. At layer J the tokens are the fresh p_J; into
# each later layer l go beta * p_l + (1 - beta) * (what layer l - 1 wrote at their places), MMRL++'s
# rule (beta 0.5: the toy recipe's). Each branch (f_cls, each f_attr) scores the classes by s *
# cos with t_c; the fused logits weigh the branches by alpha (paper Eq. 6-7).
step(7)
recipe = train.RECIPES["base2novel"]["toyworld"]
torch.manual_seed(0)
model = dear.DeAR(clip, role_map, beta=recipe.beta)  # fresh tokens, normal with std 0.02
batch = load_images(base.train[:4])  # (B, 3, R, R)
prompts = tokenizer.tokenize([base.template.format(c) for c in base.classnames], clip.context_length)
classes = model.prepare_classes(prompts)  # the frozen text layers before J, once per class list
entering = {"image": [], "text": []}  # per tower, per layer from J: (its input, its output)
hooks = [block.register_forward_hook(lambda _, args, out, tower=tower:
                                     entering[tower].append((args[0], out)))
         for tower, tower_blocks in (("image", clip.visual.transformer.resblocks),
                                     ("text", clip.transformer.resblocks))
         for block in tower_blocks[J - 1:]]
with torch.no_grad():
    f_cls, f_attr, _ = model.encode_image(batch)  # (B, E), (B, A, E)
    t = model.encode_text(classes)  # (C, E)
for hook in hooks:
    hook.remove()
K, beta, eot = model.num_text_tokens, model.beta, classes.eot  # eot: (C,), in the prompt
at = {"image": slice(N, N + A), "text": slice(1, 1 + K)}  # the tokens' places, from J on
fresh = {"image": model.tokens.vision_layer_tokens(), "text": model.tokens.text_layer_tokens()}
with torch.no_grad():
    before = {"image": clip.visual.embed(batch), "text": classes.hidden}  # what enters J
for block in clip.visual.transformer.resblocks[:J - 1]:
    before["image"] = block(before["image"])
for tower, layers in entering.items():
    size = (f"N + A = {N} + {A}: the tokens at {N}..{N + A - 1}" if tower == "image" else
            f"N' + K = {classes.hidden.shape[1]} + {K}: the tokens at 1..{K}, the prompt's after")
    show(f"{tower} side, layers {J}-{J + len(layers) - 1}: {tuple(layers[0][0].shape)}, {size}")
    for i, (inputs, _) in enumerate(layers):
        tokens = inputs[:, at[tower]]  # (B, A, W_v) or (C, K, W_t)
        if i == 0:  # layer J: the fresh tokens, amid the frozen layers' output
            rule, expected = f"p_{J}", fresh[tower][0].expand_as(tokens)
            rest = (torch.cat([inputs[:, :N], inputs[:, N + A:]], dim=1) if tower == "image"
                    else torch.cat([inputs[:, :1], inputs[:, 1 + K:]], dim=1))
            assert torch.equal(rest, before[tower])  # the image's or the prompt's own tokens
        else:  # layer J + i: MMRL++'s mixing of the fresh and the carried tokens
            rule = f"{beta} p_{J + i} + {1 - beta} (layer {J + i - 1}'s output there)"
            expected = beta * fresh[tower][i] + (1 - beta) * layers[i - 1][1][:, at[tower]]
        gap = (tokens - expected).abs().max().item()
        show(f"  layer {J + i}'s tokens: {rule:44} largest difference {gap:.0e}")
        assert inputs.shape[1] == (N + A if tower == "image" else classes.hidden.shape[1] + K)
        assert gap < 1e-6, (tower, J + i, gap)
final = entering["text"][-1][1]  # (C, N + K, W_t): the last layer's output
assert torch.allclose(t, clip.text_to_embedding(final, eot + K))  # t_c read at eot + K
show(f"t_c read at the end-of-text token: {eot[0].item()} in the first prompt, "
     f"{eot[0].item() + K} = eot + K from J on")
show(f"f_cls {tuple(f_cls.shape)}, f_attr {tuple(f_attr.shape)}, t_c {tuple(t.shape)}")
fused, branches = model.fused_logits(torch.cat([f_cls[:, None], f_attr], dim=1), t)
alpha = model.fusion_weights()  # (1 + A,)
by_hand = sum(alpha[k] * branches[:, k] for k in range(1 + A))  # (B, C)
show(f"branch logits {tuple(branches.shape)}, alpha {[round(a, 3) for a in alpha.tolist()]}: "
     f"fused {tuple(fused.shape)} = sum_k alpha_k x branch_k, largest difference "
     f"{(fused - by_hand).abs().max():.0e}")
assert f_cls.shape == (4, E) and f_attr.shape == (4, A, E) and t.shape == (len(base.classnames), E)
assert torch.allclose(fused, by_hand, atol=1e-5)
assert torch.allclose(branches[:, 0], dear.cosine_logits(f_cls, t, clip.logit_scale.exp()))

# %% Step 8. Training: the loop, a few steps in view, then train.py's 20 epochs
# train.py's loop (train_job, paper Sec. 3.4): AdamW on the learnable tensors (the tokens, the
# attribute projection, the fusion weights; CLIP stays frozen); per step the fused logits'
# cross-entropy, L_reg (the class feature and the class texts kept near plain CLIP's) and
# L_fusion = -log alpha_cls, summed with the recipe's weights. Three steps here, on the first base
# training images in order, at the recipe's lr (train.py shuffles, and warms up for an epoch).
# Then train.py trains the same model for the recipe's 20 epochs (its lines about the run below),
# and the row without the mask beside it (step 10); its metrics.jsonl has the fusion weights alpha
# after every epoch.
step(8)
torch.manual_seed(1)  # train.py's seed 1
model = dear.DeAR(clip, role_map, beta=recipe.beta)
optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=recipe.lr,
                              weight_decay=train.WEIGHT_DECAY)
for i in range(3):
    items = base.train[i * recipe.batch_size:(i + 1) * recipe.batch_size]
    targets = torch.tensor([item.label for item in items])
    output = model(load_images(items), classes, with_frozen=True)  # also plain CLIP's, for L_reg
    losses = dear.dear_loss(output, targets, recipe.lambda_reg, recipe.lambda_fusion)
    optimizer.zero_grad(set_to_none=True)
    losses["total"].backward()
    learned = {name for name, t in model.learnable_tensors().items() if t.grad is not None}
    optimizer.step()
    show(f"step {i + 1}: " + ", ".join(f"{k} {v.item():.4f}" for k, v in losses.items())
         + f"; alpha {[round(a, 3) for a in output.alpha.tolist()]}")
    assert torch.allclose(losses["total"], losses["ce"] + recipe.lambda_reg * losses["reg"]
                          + recipe.lambda_fusion * losses["fusion"])
    assert torch.allclose(losses["fusion"], -output.alpha[0].log())  # L_fusion = -log alpha_cls
    assert learned == set(model.learnable_tensors()) and all(p.grad is None
                                                             for p in clip.parameters())
show(f"gradients reach: {sorted(learned)}; CLIP's tensors: none")

RUN = tempfile.mkdtemp(prefix="dear-walkthrough-")  # train.py's run folder, for steps 8-11
with redirect_stdout(StringIO()) as printed:  # its lines; the page keeps the runs' own
    train.main(["--dataset", "toyworld", "--method", "dear", "--roles", "analyse", "all-mixed",
                "--seeds", "1", "--output", RUN])
for line in printed.getvalue().splitlines():
    if line.startswith("[toyworld / dear / seed 1]"):
        show(line)
show("train.py trained 2 rows; the DeAR row's metrics.jsonl:")
DEAR_RUN = os.path.join(RUN, "toyworld", "dear", "seed1")
with open(os.path.join(DEAR_RUN, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
for record in records[::4] + records[-1:]:
    show(f"  epoch {record['epoch']:2}: loss {record['loss']['total']:.3f}, alpha "
         + " ".join(f"{k} {v:.3f}" for k, v in record["alpha"].items()))
pictures.draw_curves(records, "toyworld / dear / seed 1", recipe.epochs, picture("curves.png"))
assert all(abs(sum(r["alpha"].values()) - 1) < 1e-5 for r in records)  # a softmax
trained_roles = dear.RoleMap.load(os.path.join(RUN, "toyworld", "roles", "roles.json"))
assert [(h.role, h.attribute) for h in trained_roles.heads] == \
       [(h.role, h.attribute) for h in role_map.heads]  # train.py's analysis is step 4's

# %% Step 9. Scoring base and novel classes, under both fusion rules
# A test image gets two kinds of logits in one pass: the fused ones (every branch weighted by
# alpha) and the class branch's alone. On the base classes DeAR uses the fused ones; on novel
# classes the paper does not say, so both rules are reported (dear.scoring_logits, METHOD.md Sec. 5).
# Each test set is scored at its own beta (dear.test_beta, beside the rule in dear.py): the training
# one on base and novel, MMRL++'s own on a cross-dataset target. The trained tokens are loaded
# from train.py's checkpoint; the accuracies must be train.py's.
step(9)
checkpoint = torch.load(os.path.join(DEAR_RUN, "checkpoint.pt"), map_location="cpu",
                        weights_only=True)
model = dear.DeAR(clip, trained_roles, beta=checkpoint["settings"]["beta"])
model.load_learnable_state_dict(checkpoint["learnable"])
model.eval()


@torch.no_grad()
def accuracies(split, beta: float) -> dict:
    """{"fused": %, "class": %} on a split's test images, DeAR's tokens mixed at `beta`."""
    ids = tokenizer.tokenize([split.template.format(c) for c in split.classnames],
                             clip.context_length)
    text = model.encode_text(model.prepare_classes(ids), beta)  # (C, E), with the text tokens
    right = Counter()
    for start in range(0, len(split.test), 64):
        chunk = split.test[start:start + 64]
        f_cls, f_attr, _ = model.encode_image(load_images(chunk), beta=beta)  # (B, E), (B, A, E)
        fused, branches = model.fused_logits(torch.cat([f_cls[:, None], f_attr], dim=1), text)
        labels = torch.tensor([item.label for item in chunk])
        right["fused"] += (fused.argmax(-1) == labels).sum().item()
        right["class"] += (branches[:, 0].argmax(-1) == labels).sum().item()
    return {kind: 100 * right[kind] / len(split.test) for kind in ("fused", "class")}


with open(os.path.join(DEAR_RUN, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
beta = checkpoint["settings"]["beta"]  # the training beta
betas = {s: dear.test_beta(s, trained=s == "base", beta=beta) for s in ("base", "novel")}
measured = {s: accuracies(split, betas[s]) for s, split in (("base", base), ("novel", novel))}
for rule in ("fused-everywhere", "class-on-unseen"):
    chosen = {s: dear.scoring_logits(rule, trained=s == "base") for s in measured}
    b, v = (measured[s][chosen[s]] for s in ("base", "novel"))
    show(f"{rule:>16}: base {b:.2f} ({chosen['base']}), novel {v:.2f} ({chosen['novel']}), "
         f"HM {2 * b * v / (b + v):.2f}")
    assert abs(2 * b * v / (b + v) - results["metrics_by_fusion"][rule]["hm"]) < 1e-6
show(f"beta at test: {betas} (the training beta); the cross protocol's "
     f"targets take MMRL++'s own, e.g. " + ", ".join(
         f"{k} {dear.test_beta(k, False, beta)}" for k in ("dtd", "eurosat", "imagenet_sketch")))
other = accuracies(novel, 0.3)["fused"]
show(f"novel at beta 0.3 (more of the previous layer's tokens, eurosat's): {other:.2f}")
for split in measured:  # the invariant: the walkthrough scores what train.py scored
    for kind in ("fused", "class"):
        assert abs(measured[split][kind] - results["accuracy_by_logits"][split][kind]) < 1e-6
assert betas == results["test_beta"]  # the betas train.py scored at

# %% Step 10. One ablation flipped (no role mask), and one control of the paper's question
# dear.ablate makes each of the paper's ablations as one change to the DeAR row. "no-role-mask"
# makes every analysed head mixed: the tokens reach every head, as in deep prompting without a
# mask. train.py trained that row beside DeAR in step 8 (the --roles all-mixed row).
step(10)
change = dear.ablate("no-role-mask", trained_roles, attributes, recipe.lambda_fusion)
ablated = dear.DeAR(clip, change.role_map, change.attributes, beta=beta)
opened = (torch.isinf(model.role_masks) & torch.isfinite(ablated.role_masks)).sum().item()
show(f"the change: every head {set(h.role for h in change.role_map.heads)}; "
     f"{opened:,} of {model.role_masks.numel():,} mask entries opened; the loss, the tokens "
     f"and the fusion unchanged (lambda_fusion {change.lambda_fusion})")
with open(os.path.join(RUN, "toyworld", "dear-all-mixed", "seed1", "results.json"),
          encoding="utf-8") as f:
    unmasked = json.load(f)["metrics"]
show("trained, fused everywhere: " + "; ".join(
    f"{s} {results['metrics_by_fusion']['fused-everywhere'][s]:.2f} with the mask, "
    f"{unmasked[s]:.2f} without" for s in ("base", "novel", "hm")))
with torch.no_grad(), warnings.catch_warnings():  # (its warning: the tokens are blind)
    warnings.simplefilter("ignore", dear.LeftOutWarning)
    alone = dear.DeAR(clip, dear.RoleMap.uniform("generalization", depth, H, list(range(depth)),
                                                 attributes), beta=beta)
    f_cls, _, f_frozen = alone.encode_image(images[:8], with_frozen=True)
show(f"all heads generalization instead: the class feature is frozen CLIP's "
     f"(largest difference {(f_cls - f_frozen).abs().max():.1e})")
assert all(h.role == "mixed" for h in change.role_map.heads)
assert torch.equal(ablated.role_masks, torch.zeros_like(ablated.role_masks))
assert torch.allclose(f_cls, f_frozen, atol=1e-5)  # no head lets the tokens into the image
# The paper's question (docs/TOYWORLD.md, "The paper's question"): do entropy's heads matter, or
# only how many are open? "shuffled-heads" moves every head's role to another head, each role's
# count kept. Trained beside DeAR on 3 seeds it scores as well (HM 90.05 +- 0.32 against
# 89.67 +- 0.35, a gap inside the spread): on the toy, which heads open is not a finding.
shuffled = dear.ablate("shuffled-heads", trained_roles, attributes, recipe.lambda_fusion,
                       seed=1).role_map
kinds = lambda m: Counter((h.role, h.attribute) for h in m.heads)  # noqa: E731
moved = sum(a.role != b.role or a.attribute != b.attribute
            for a, b in zip(trained_roles.heads, shuffled.heads))
show(f"shuffled heads (seed 1): each role's count kept ({kinds(shuffled) == kinds(trained_roles)}), "
     f"{moved} of {len(shuffled.heads)} heads hold another role than entropy gave them")
assert kinds(shuffled) == kinds(trained_roles) and moved > 0

# %% Step 11. Retrieval: what an attribute token's feature finds
# The paper's check that a token carries its attribute: rank test images by the cosine of one
# feature and ask whether the neighbours share the query's attribute value (precision@10). The toy
# world knows every image's colour, shape, texture and position. In the table a row is the
# feature that ranks, a column the attribute whose value must be shared (chance: 25%, shape 17%);
# the diagonal is each token on its own attribute. The paper's goal is a token that retrieves its
# attribute better than the class feature does. On the toy none does: the position and texture
# tokens come nearest, the colour and shape tokens fall far below it (docs/TOYWORLD.md,
# "Attribute-conditioned retrieval": the tokens learn only through the fused class logits).
# train.py ran the same check (retrieval.json): the walkthrough's numbers must be its.
step(11)
gallery_items = dear.analysis_images(list({i.path: i for i in base.test + novel.test}.values()),
                                     probes.RETRIEVAL_GALLERY, seed=0)
features = dear.retrieval_features(model, load_images(gallery_items))  # {name: (M, E)}
rankings = {name: dear.rank_gallery(f, f, k=probes.RETRIEVAL_K, same_images=True)
            for name, f in features.items()}  # {name: (M, k)}
scenes = split_scenes(assets.data_root)
images_dir = os.path.join(assets.data_root, "toyworld", "images")
values = {a: [getattr(scenes[os.path.relpath(i.path, images_dir).replace(os.sep, "/")], a)
              for i in gallery_items] for a in attributes}
with open(os.path.join(RUN, "retrieval.json"), encoding="utf-8") as f:
    recorded = json.load(f)["dear"]
show(f"precision@{probes.RETRIEVAL_K} (%) of {len(gallery_items)} test images: "
     f"row = the feature ranking, column = the value shared")
show(f"{'':>12} " + " ".join(f"{a:>9}" for a in attributes))
for name, ranking in rankings.items():
    shares = [100 * dear.precision_at_k(ranking, values[a], values[a]) for a in attributes]
    show(f"{name:>12} " + " ".join(f"{s:9.1f}" for s in shares))
    assert all(abs(s - recorded[name][a][0]) < 1e-6 for s, a in zip(shares, attributes))
own = {a: 100 * dear.precision_at_k(rankings[a], values[a], values[a]) for a in rankings
       if a in attributes}  # each token's feature on its own attribute
show("each token on its own attribute, against the class feature: " + ", ".join(
    f"{a} {p:.1f} vs {100 * dear.precision_at_k(rankings['class'], values[a], values[a]):.1f}"
    for a, p in own.items()))
pictures.draw_retrieval(gallery_items, {"class": rankings["class"], "position": rankings["position"]},
                        R, probes.RETRIEVAL_QUERIES, probes.RETRIEVAL_SHOWN,
                        os.path.dirname(picture("retrieval_class.png")), "toyworld / dear / seed 1")
picture("retrieval_position.png")
for ranking in rankings.values():  # no image is its own neighbour
    assert not (ranking == torch.arange(len(gallery_items))[:, None]).any()

# %% The page: docs/walkthrough.md from this file's cells and what each step printed
import shutil  # noqa: E402

import walkthrough_page  # noqa: E402

shutil.rmtree(RUN)
page = walkthrough_page.write(
    globals().get("__file__", os.path.join(HERE, "walkthrough.py")),
    "Written by `python docs/walkthrough.py` (each step's code, what it printed, its pictures); "
    f"the numbers are the machine's that ran it (torch {torch.__version__.split('+')[0]}, one CPU "
    "thread). It took 84 CPU-seconds from an empty cache (`/usr/bin/time`, on a shared 2-core "
    "machine; the wall time grows with what else runs). Run it, then read `dear.py`.")
print(f"\nwalkthrough: every step's invariant held; {page}")
