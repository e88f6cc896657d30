"""Tests of the toy world (toyworld/): the renderer, captions, the learned BPE, pretraining and
its cache, the CoOp-layout task, and the head-ablation check.

Everything runs at the "miniature" scale (16 px images, a 2-layer CLIP, a few dozen steps) in
a temporary cache folder (cache_dir=tmp_path), so nothing touches ~/.cache. About 20 s on 2 cores.

Run:  python -m pytest -q tests/test_toyworld.py
"""

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import clip_model
import data
import dear
import toyworld
from toyworld import causal, pretrain, task, world
from toyworld.bpe import words_of, write_bpe

from conftest import assert_close

# ------------------------------------------------------------------------------------------
# Shared: one miniature world for the whole module (prepare is the slow part)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """prepare("miniature") in a fresh cache; yields (assets, cache root, log lines)."""
    root = str(tmp_path_factory.mktemp("toycache"))
    lines = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEAR_CACHE_DIR", root)
        assets = toyworld.prepare("miniature", log=lines.append)
        yield assets, root, lines


@pytest.fixture(scope="module")
def mini_model(mini):
    assets = mini[0]
    model, _ = clip_model.load(assets.weights, head_width=assets.head_width)
    return model, clip_model.SimpleTokenizer(assets.bpe)


# ------------------------------------------------------------------------------------------
# The world: renderer and captions


def test_render_is_deterministic_by_seed_and_varies_with_it():
    scene = world.Scene("red", "star", "striped", "bottom right", "small", "light")
    first = world.render(scene, seed=3)
    assert first.shape == (32, 32, 3) and first.dtype == np.uint8
    assert np.array_equal(first, world.render(scene, seed=3))
    assert not np.array_equal(first, world.render(scene, seed=4))
    batch_a = world.render_batch([scene] * 3, np.random.default_rng(0), 16, "shifted")
    batch_b = world.render_batch([scene] * 3, np.random.default_rng(0), 16, "shifted")
    assert batch_a.shape == (3, 16, 16, 3) and np.array_equal(batch_a, batch_b)


def test_every_attribute_value_is_drawn_over_a_modest_sample():
    rng = random.Random(0)
    scenes = [world.sample_scene(rng) for _ in range(300)]
    for name, values in {**world.ATTRIBUTES, **world.EXTRA_ATTRIBUTES}.items():
        assert {scene.value(name) for scene in scenes} == set(values), f"{name}: some value never drawn"
    fixed = [world.sample_scene(rng, colour="blue", shape="cross") for _ in range(20)]
    assert {(s.colour, s.shape) for s in fixed} == {("blue", "cross")}


def test_the_object_is_drawn_in_its_colour_and_quadrant():
    """Saturated pixels (max - min channel > 60) are the object's: the background is grey.
    Their centroid must lie in the named quadrant, their median colour be nearest the named one."""
    rng = random.Random(1)
    for index in range(40):
        scene = world.sample_scene(rng, texture="solid", background="dark")
        pixels = world.render(scene, seed=index).astype(int)
        saturated = (pixels.max(-1) - pixels.min(-1)) > 60  # (32, 32)
        ys, xs = np.nonzero(saturated)
        assert len(ys) > 10, f"{scene}: object not found"
        vertical = "top" if ys.mean() < 16 else "bottom"
        horizontal = "left" if xs.mean() < 16 else "right"
        assert f"{vertical} {horizontal}" == scene.position, scene
        median = np.median(pixels[saturated], axis=0)
        nearest = min(world.COLOUR_RGB, key=lambda c: np.linalg.norm(median - world.COLOUR_RGB[c]))
        assert nearest == scene.colour, f"{scene}: drawn colour {median} looks {nearest}"


def test_captions_name_exactly_the_requested_attributes():
    scene = world.Scene("red", "circle", "striped", "top left", "small", "dark")
    assert world.caption(scene, ["colour"]) == "a photo of a red object"
    assert world.caption(scene, ["shape"]) == "a photo of a circle"
    assert world.caption(scene, ["texture", "position"], prefix="a") == "a striped object at the top left"
    assert world.caption(scene, period=True) == (
        "a photo of a small red striped circle at the top left on a dark background.")
    assert world.attribute_prompts("colour")[:2] == ["a photo of a red object", "a photo of a orange object"]
    named = {"colour", "shape"}
    assert world.describes(scene, named, world.Scene("red", "circle", "dotted", "top right"))
    assert not world.describes(scene, named, world.Scene("blue", "circle", "striped", "top left"))
    rng = random.Random(0)
    for _ in range(50):
        other = world.sample_scene(rng)
        named = world.random_naming(rng)
        text = world.random_caption(other, rng, named)
        for name in world.ATTRIBUTES:
            assert (other.value(name) in text) == (name in named) or name == "shape", (text, named)


def test_toy_bank_is_labelled_and_large_enough():
    bank = world.toy_bank()
    assert len(bank) >= 100 and len({text for text, _, _ in bank}) == len(bank)
    concepts = {concept for _, concept, _ in bank}
    assert set(world.ATTRIBUTES) <= concepts and len(concepts - set(world.ATTRIBUTES)) >= 2
    for text, concept, value in bank:  # labelled by construction: a concept's phrase names its value
        if concept in world.ATTRIBUTES:
            assert value in world.ATTRIBUTES[concept] and value in text, (text, concept, value)
    # The picks its attributes support: the fewest values (texture, position: 4).
    assert dear.default_picks(bank, list(world.ATTRIBUTES)) == 4


# ------------------------------------------------------------------------------------------
# The BPE


def test_learned_bpe_round_trips_every_caption_and_bank_phrase(tmp_path):
    path = str(tmp_path / "toy_bpe.txt.gz")
    vocab_size = write_bpe(world.corpus(), path)
    tokenizer = clip_model.SimpleTokenizer(path)
    assert tokenizer.vocab_size == vocab_size < 1000, "vocabulary should be small"
    rng = random.Random(0)
    texts = world.corpus() + [text for text, _, _ in world.toy_bank()]
    texts += [world.random_caption(world.sample_scene(rng), rng) for _ in range(300)]
    texts += [world.TEMPLATE.format(task.class_name(c, s)) for c, s, _ in task.class_table(task.TaskConfig())]
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids).split() == [w.replace("</w>", "") for w in words_of(text)], text
        assert len(ids) == len(words_of(text)), f"{text!r}: some word is not a single token"
    assert not os.path.exists(path + ".tmp") and len(os.listdir(tmp_path)) == 1, "temp file left behind"


# ------------------------------------------------------------------------------------------
# Pretraining and the cache


def test_model_input_equals_data_test_transform_of_the_saved_png(tmp_path):
    pixels = world.render_batch([world.sample_scene(random.Random(0))], np.random.default_rng(0), 16)
    Image.fromarray(pixels[0]).save(tmp_path / "x.png")
    expected = data.test_transform(16)(data.load_image(str(tmp_path / "x.png")))
    assert torch.equal(pretrain.to_model_input(pixels)[0], expected)


def test_contrastive_loss_counts_every_true_caption_as_positive():
    features = torch.eye(3)
    scale = torch.tensor(0.0)  # s = 1
    one_hot = pretrain.contrastive_loss(features, features, scale, torch.eye(3, dtype=torch.bool))
    expected = torch.nn.functional.cross_entropy(features @ features.T, torch.arange(3))
    assert_close(one_hot, expected, 1e-6, "one-hot positives = CLIP's loss")
    everything = pretrain.contrastive_loss(features, features, scale, torch.ones(3, 3, dtype=torch.bool))
    assert everything.item() != pytest.approx(one_hot.item())


def test_saved_checkpoint_reloads_with_the_same_embeddings(tmp_path):
    path = str(tmp_path / "bpe.txt.gz")
    write_bpe(world.corpus(), path)
    tokenizer = clip_model.SimpleTokenizer(path)
    config = pretrain.replace(pretrain.CONFIGS["miniature"], max_steps=3, eval_every=3, log_every=3)
    model, _ = pretrain.pretrain(config, tokenizer, log=lambda line: None)
    torch.save(model.state_dict(), tmp_path / "clip.pt")
    loaded, preprocess = clip_model.load(str(tmp_path / "clip.pt"), head_width=config.head_width)
    images, _ = pretrain.draw_batch(0, 4, config.image_size)
    ids = tokenizer.tokenize(world.attribute_prompts("shape"), config.context_length)
    with torch.no_grad():
        assert_close(loaded.encode_image(images), model.encode_image(images), 1e-6, "image embeddings")
        assert_close(loaded.encode_text(ids), model.encode_text(ids), 1e-6, "text embeddings")


def test_prepare_writes_a_checkpoint_that_loads_with_its_head_width(mini, mini_model):
    assets, root, lines = mini
    model, tokenizer = mini_model
    assert assets.weights.startswith(os.path.join(root, "toyworld", "miniature"))
    assert model.visual.transformer.heads == 64 // assets.head_width
    assert model.token_embedding.num_embeddings == tokenizer.vocab_size
    assert model.visual.input_resolution == assets.image_size == 16
    assert assets.attributes == list(world.ATTRIBUTES) and assets.bank == world.toy_bank()
    assert any("step" in line for line in lines), "pretraining printed no progress line"


def test_second_prepare_reuses_the_cache(mini, monkeypatch):
    assets, root, _ = mini
    monkeypatch.setenv("DEAR_CACHE_DIR", root)
    mtime = os.path.getmtime(assets.weights)
    lines = []
    again = toyworld.prepare("miniature", log=lines.append)
    assert again.weights == assets.weights and os.path.getmtime(assets.weights) == mtime
    assert any("reusing the cached model" in line for line in lines)
    assert any("toy task: reusing" in line for line in lines)
    assert not any("step" in line for line in lines), "it retrained"


def test_a_cache_drawn_from_another_version_of_the_world_is_not_reused(mini, monkeypatch):
    """Editing one of world.py's tables (here how dark a texture is drawn) changes the world's
    fingerprint, so neither the cached toy CLIP nor the cached task is taken as up to date."""
    assets = mini[0]
    folder = os.path.dirname(assets.weights)
    task_config = task.TaskConfig(**toyworld.SCALES["miniature"]["task"])
    assert pretrain._check_cache(folder, pretrain.CONFIGS["miniature"])[0] is not None
    assert task.task_is_complete(assets.data_root, task_config)
    monkeypatch.setattr(world, "PATTERN_SHADE", world.PATTERN_SHADE + 0.1)
    record, reason = pretrain._check_cache(folder, pretrain.CONFIGS["miniature"])
    assert record is None and "another version of the world" in reason
    assert not task.task_is_complete(assets.data_root, task_config)


def test_two_builds_with_the_same_settings_give_identical_weights_whatever_the_callers_threads(mini, tmp_path):
    """The build runs a fixed number of steps on a fixed number of threads: a second build, in
    another cache and from a caller set to other threads, gives the same weights bit for bit,
    and the caller's thread setting is restored afterwards."""
    assets = mini[0]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if pretrain.CONFIGS["miniature"].threads != 2 else 1)
        callers = torch.get_num_threads()
        again = pretrain.pretrained_clip(pretrain.CONFIGS["miniature"], str(tmp_path), log=lambda line: None)
        assert torch.get_num_threads() == callers, "the build did not restore the caller's thread count"
    finally:
        torch.set_num_threads(before)
    first = torch.load(assets.weights, weights_only=True)
    second = torch.load(again.weights, weights_only=True)
    assert first.keys() == second.keys()
    tensors = [key for key in first if isinstance(first[key], torch.Tensor)]
    assert len(tensors) > 20 and all(torch.equal(first[key], second[key]) for key in tensors), "two builds differ"
    assert {k: v for k, v in first.items() if k not in tensors} == {k: v for k, v in second.items() if k not in tensors}
    # ... and the same bytes: a file's SHA-256 names the model (the shipped one is checked so)
    assert clip_model._sha256(assets.weights) == clip_model._sha256(again.weights), "same tensors, other bytes"
    assert clip_model._sha256(assets.bpe) == clip_model._sha256(again.bpe), "same merges, other bytes"
    report = again.report  # config.json says what was built and with what
    config = pretrain.CONFIGS["miniature"]
    assert (report["steps"], report["threads"], report["torch"]) == (config.max_steps, config.threads, torch.__version__)


def test_twin_scenes_differ_in_exactly_one_core_attribute():
    scenes = pretrain.training_scenes(random.Random(0), 40, twin_share=1.0)
    assert len(scenes) == 40
    twins = 0
    for scene in scenes:
        differing = [[name for name in world.SCENE_FIELDS if scene.value(name) != other.value(name)]
                     for other in scenes if other is not scene]
        twins += any(len(names) == 1 and names[0] in world.ATTRIBUTES for names in differing)
    assert twins >= 36  # every scene has its twin (a chance pair among the rest is possible too)
    assert len(pretrain.training_scenes(random.Random(0), 41, twin_share=0.5)) == 41


def test_corrupt_cached_checkpoint_is_rebuilt(mini, tmp_path, monkeypatch):
    _, root, _ = mini
    copy = str(tmp_path / "cache")
    shutil.copytree(root, copy)
    monkeypatch.setenv("DEAR_CACHE_DIR", copy)
    weights = os.path.join(copy, "toyworld", "miniature", "clip.pt")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)  # a half-written file
    lines = []
    assets = toyworld.prepare("miniature", log=lines.append)
    assert any("building it" in line and "cannot be read" in line for line in lines), lines[:2]
    clip_model.load(assets.weights, head_width=assets.head_width)  # loads again


def test_cache_json_of_the_wrong_shape_is_rebuilt_not_a_crash(mini, tmp_path, monkeypatch):
    _, root, _ = mini
    copy = str(tmp_path / "cache")
    shutil.copytree(root, copy)
    monkeypatch.setenv("DEAR_CACHE_DIR", copy)
    folder = os.path.join(copy, "toyworld", "miniature")
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("[]")  # valid JSON, wrong shape
    with open(os.path.join(folder, "data", "toyworld", task.RECORD_FILE), "w") as f:
        f.write('"a string"')
    lines = []
    assets = toyworld.prepare("miniature", log=lines.append)
    assert any("config.json is JSON of the wrong shape" in line for line in lines), lines[:3]
    assert any("toy task: wrote" in line for line in lines), lines
    clip_model.load(assets.weights, head_width=assets.head_width)
    assert data.load_dataset("toyworld", assets.data_root).test
    task_config = task.TaskConfig(**toyworld.SCALES["miniature"]["task"])
    assert task.task_is_complete(assets.data_root, task_config)
    with open(os.path.join(assets.data_root, "toyworld", task.SPLIT_FILE), "w") as f:
        f.write('{"train": [5]}')  # valid JSON, wrong shape: not complete, and no crash
    assert not task.task_is_complete(assets.data_root, task_config)


@pytest.mark.parametrize("flags, message", [
    (["--cache-dir", "FILE"], "--cache-dir FILE: is a file, not a folder"),
    (["--cache-dir", "FILE/under"], "lies under FILE, which is a file"),
    (["--grid", "NOWHERE/grid.png"], "its folder does not exist"),
    (["--grid", "FOLDER"], "expected an image file name"),
    (["--scale", "huge"], "argument --scale: invalid choice"),
])
def test_command_line_bad_paths_are_one_line_before_any_work(tmp_path, monkeypatch, capsys, flags, message):
    import importlib

    cli = importlib.import_module("toyworld.__main__")
    (tmp_path / "file").write_text("x")
    paths = {"FILE": str(tmp_path / "file"), "NOWHERE": str(tmp_path / "nowhere"), "FOLDER": str(tmp_path)}
    for placeholder, path in paths.items():
        flags, message = [f.replace(placeholder, path) for f in flags], message.replace(placeholder, path)
    monkeypatch.setattr(toyworld, "prepare", lambda *a, **k: pytest.fail("the world was prepared first"))
    try:
        code = cli.main(flags)
    except SystemExit as done:  # argparse's own errors
        code = done.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith("python -m toyworld: error: ") and message in err, err


# ------------------------------------------------------------------------------------------
# The downstream task


def test_task_loads_with_data_py_and_novel_classes_are_unseen_combinations(mini):
    assets = mini[0]
    spec = data.get_spec("toyworld")
    assert (spec.folder, spec.reader, spec.image_dir, spec.split_file) == (
        "toyworld", "split_json", "images", "split_toyworld.json")
    base = data.load_dataset("toyworld", assets.data_root, num_shots=16, seed=1, subsample="base")
    novel = data.load_dataset("toyworld", assets.data_root, num_shots=16, seed=1, subsample="novel")
    assert len(base.classnames) == len(novel.classnames) == 12
    assert len(base.train) == 16 * 12 and {item.label for item in base.train} == set(range(12))
    assert base.prompts[0] == "a photo of a red circle."
    base_pairs = {tuple(name.split()) for name in base.classnames}
    novel_pairs = {tuple(name.split()) for name in novel.classnames}
    assert not base_pairs & novel_pairs
    for colour, shape in novel_pairs:  # unseen combination of values base classes use
        assert any(c == colour for c, _ in base_pairs) and any(s == shape for _, s in base_pairs)
    with Image.open(base.test[0].path) as image:
        assert image.size == (16, 16)


def test_task_is_rebuilt_when_incomplete(tmp_path):
    config = task.TaskConfig(image_size=8, images_per_class=(1, 1, 1))
    folder = task.write_task(str(tmp_path), config, log=lambda line: None)
    assert task.task_is_complete(str(tmp_path), config)
    os.remove(os.path.join(folder, "images", "red_circle", "test_000.png"))
    assert not task.task_is_complete(str(tmp_path), config)
    task.write_task(str(tmp_path), config, log=lambda line: None)
    assert task.task_is_complete(str(tmp_path), config)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == [], "temporary folder left behind"


def test_split_scenes_are_the_scenes_the_task_images_were_drawn_from(tmp_path):
    config = task.TaskConfig(image_size=8, images_per_class=(1, 1, 3), seed=4)
    folder = task.write_task(str(tmp_path), config, log=lambda line: None)
    scenes = task.split_scenes(str(tmp_path), "test")
    with open(os.path.join(folder, task.SPLIT_FILE), encoding="utf-8") as f:
        assert sorted(scenes) == sorted(entry[0] for entry in json.load(f)["test"])
    for label, (colour, shape, _) in enumerate(task.class_table(config)):
        paths = [f"{colour}_{shape}/test_{i:03d}.png" for i in range(3)]
        assert all((scenes[p].colour, scenes[p].shape) == (colour, shape) for p in paths)
        # The other attributes are only right if the same scenes redraw the same pixels.
        redrawn = world.render_batch([scenes[p] for p in paths], np.random.default_rng([4, label, 2]), 8, config.style)
        for path, pixels in zip(paths, redrawn):
            with Image.open(os.path.join(folder, "images", path)) as image:
                assert (np.asarray(image) == pixels).all(), path


# ------------------------------------------------------------------------------------------
# The causal check


def test_ablation_hook_replaces_only_that_head_and_removing_it_restores_the_model(mini_model):
    model, _ = mini_model
    images, _ = pretrain.draw_batch(0, 8, 16)
    means = causal.mean_head_outputs(model, images, [1])
    seen = {}
    out_proj = model.visual.transformer.resblocks[1].attn.out_proj
    handle = out_proj.register_forward_hook(lambda module, inputs, output: seen.update(x=inputs[0].clone()))
    with torch.no_grad():
        plain = model.encode_image(images)
        clean_input = seen["x"]
        with causal.ablate_heads(model, [(1, 0)], means):
            ablated = model.encode_image(images)
        ablated_input = seen["x"]
        restored = model.encode_image(images)
    handle.remove()
    D = model.visual.transformer.resblocks[1].attn.head_dim
    assert torch.equal(ablated_input[..., :D], means[1][..., :D].expand_as(ablated_input[..., :D]))
    assert torch.equal(ablated_input[..., D:], clean_input[..., D:]), "other heads must be untouched"
    assert not torch.allclose(ablated, plain), "ablating a head changed nothing"
    assert torch.equal(restored, plain), "the hook was not removed"
    assert not out_proj._forward_pre_hooks


def test_group_ablation_replaces_every_head_of_the_group_across_layers(mini_model):
    model, _ = mini_model
    images, _ = pretrain.draw_batch(0, 8, 16)
    means = causal.mean_head_outputs(model, images, [0, 1])
    D = model.visual.transformer.resblocks[1].attn.head_dim
    seen = {}
    handles = [model.visual.transformer.resblocks[layer].attn.out_proj.register_forward_hook(
        lambda module, inputs, output, layer=layer: seen.update({layer: inputs[0].clone()})) for layer in (0, 1)]
    with torch.no_grad():
        plain = model.encode_image(images)
        with causal.ablate_heads(model, [(1, 0), (1, 1), (0, 1)], means):
            ablated = model.encode_image(images)
        during = dict(seen)  # the inputs while ablated
        restored = model.encode_image(images)
    for handle in handles:
        handle.remove()
    assert torch.equal(during[1], means[1].expand_as(during[1])), "both heads of layer 2 replaced by their means"
    assert torch.equal(during[0][..., D:], means[0][..., D:].expand_as(during[0][..., D:]))
    assert not torch.equal(during[0][..., :D], means[0][..., :D].expand_as(during[0][..., :D])), "head 0 of layer 1 kept"
    assert not torch.allclose(ablated, plain) and torch.equal(restored, plain)


def test_singled_out_follows_the_documented_rule():
    assert causal._singled_out({"colour": 0.30, "shape": 0.10, "texture": 0.0}, 0.02, 2.0) == "colour"
    assert causal._singled_out({"colour": 0.30, "shape": 0.20, "texture": 0.0}, 0.02, 2.0) is None
    assert causal._singled_out({"colour": 0.01, "shape": -0.1, "texture": 0.0}, 0.02, 2.0) is None


def test_causal_check_returns_a_well_formed_table(mini_model):
    model, tokenizer = mini_model
    heads = [dear.HeadRole(1, 0, "attribute", "colour", 0.5), dear.HeadRole(1, 1, "generalization", None, 2.0)]
    role_map = dear.RoleMap(2, 2, list(world.ATTRIBUTES), heads)
    result = causal.causal_check(model, tokenizer, role_map, n_images=64, log=lambda line: None)
    assert set(result["baseline"]) == set(world.ATTRIBUTES) and result["measure"] == "log_prob"
    assert [(row["layer"], row["head"]) for row in result["heads"]] == [(1, 0), (1, 1)]
    for row in result["heads"]:
        assert set(row["drops"]) == set(row["log_prob_drops"]) == set(world.ATTRIBUTES)
        assert row["top_attribute"] == max(row["log_prob_drops"], key=row["log_prob_drops"].get)
        assert row["agrees"] == (row["singled_out"] == "colour" if row["role"] == "attribute"
                                 else row["singled_out"] is None)
    assert result["scored"] == 2
    assert result["agreement_rate"] == sum(row["agrees"] for row in result["heads"]) / 2
    table_rows = [line for line in result["table"].splitlines() if line.startswith("| 2 |")]
    assert len(table_rows) == 2 and all(line.count("|") == 12 for line in table_rows)
    assert result["direct_agreement_rate"] == sum(row["direct"]["agrees"] for row in result["heads"]) / 2

    # Groups: one per role present and one per attribute concept entropy names; a group of one
    # head is that head's ablation, so its drops are the head's.
    groups = {group["name"]: group for group in result["groups"]}
    assert {name for name in groups if "(ablation)" not in name} == {
        "all attribute heads", "all generalization heads", "colour heads (entropy)"}
    for attribute in world.ATTRIBUTES:  # ablation's own groups: heads whose removal singles it out
        expected = [(row["layer"], row["head"]) for row in result["heads"] if row["singled_out"] == attribute]
        assert groups.get(f"{attribute} heads (ablation)", {"heads": []})["heads"] == expected
    assert groups["colour heads (entropy)"]["log_prob_drops"] == result["heads"][0]["log_prob_drops"]
    assert groups["all generalization heads"]["agrees"] == (groups["all generalization heads"]["singled_out"] is None)
    assert groups["colour heads (entropy)"]["agrees"] == (groups["colour heads (entropy)"]["singled_out"] == "colour")
    assert groups["all attribute heads"]["agrees"] is None and result["groups_scored"] == 2
    assert "| colour heads (entropy) | 1 |" in result["table"]
    listed = [line.split(" | ")[:2] for line in result["table"].splitlines() if line.startswith("| 2.")]
    assert listed == [[f"| 2.{row['head']}", row["singled_out"]] for row in result["heads"] if row["singled_out"]]


def test_a_heads_direct_path_alone_is_its_term_of_the_decomposed_embedding_set_to_its_mean(mini_model):
    # Recomputed here from clip_model.head_contributions on causal_check's own draws (seed 1, its means
    # from seed 2): a wrong sign, a missing mean, or another head's or layer's term gives other drops.
    model, tokenizer = mini_model
    heads = [dear.HeadRole(layer, head, "generalization", None, 2.0) for layer in (0, 1) for head in (0, 1)]
    result = causal.causal_check(model, tokenizer, dear.RoleMap(2, 2, list(world.ATTRIBUTES), heads), n_images=32,
                                 log=lambda line: None)
    size = model.visual.input_resolution
    (images, scenes), (reference, _) = pretrain.draw_batch(1, 32, size), pretrain.draw_batch(2, 32, size)
    text = pretrain.prompt_features(model, tokenizer, world.ATTRIBUTES)
    with torch.no_grad():
        baseline, embeddings = pretrain.zero_shot_scores(model, images, scenes, text), model.encode_image(images)
        terms = clip_model.head_contributions(model, images, 2).heads  # (B, 2, 2, E)
        means = clip_model.head_contributions(model, reference, 2).heads.mean(dim=0)  # (2, 2, E)
    for row in result["heads"]:
        edited = embeddings - terms[:, row["layer"], row["head"]] + means[row["layer"], row["head"]]
        scores = pretrain.zero_shot_scores(model, images, scenes, text, edited)
        expected = {a: baseline[a]["log_prob"] - scores[a]["log_prob"] for a in world.ATTRIBUTES}
        assert row["direct"]["log_prob_drops"] == pytest.approx(expected, abs=1e-4)
    first_layer = [row for row in result["heads"] if row["layer"] == 0]  # they also act through layer 2
    assert any(row["direct"]["log_prob_drops"] != pytest.approx(row["log_prob_drops"], abs=1e-3) for row in first_layer)


# ------------------------------------------------------------------------------------------
# The shipped model: the full scale's toy CLIP is part of the repository, checked by SHA-256


def test_full_scale_uses_the_shipped_model_whose_sha256_the_docs_record(tmp_path):
    """prepare's model step for "full" is the shipped file, verified, with no pretraining;
    docs/TOYWORLD.md, which the README's quick start links, states the same SHA-256."""
    lines = []
    cached = pretrain.pretrained_clip(pretrain.CONFIGS["full"], str(tmp_path), log=lines.append)
    expected = pretrain.SHIPPED_SHA256["full"]
    assert cached.weights == os.path.join(pretrain.SHIPPED_FOLDER, "full", "clip.pt")
    assert clip_model._sha256(cached.weights) == expected["clip.pt"]
    assert clip_model._sha256(cached.bpe) == expected["bpe.txt.gz"]
    assert not any("step" in line for line in lines) and not os.listdir(tmp_path), "it built instead"
    model, _ = clip_model.load(cached.weights)  # the file carries its head counts
    assert model.visual.transformer.heads == 8 and model.visual.input_resolution == 48
    docs = open(os.path.join(os.path.dirname(pretrain.__file__), "..", "docs", "TOYWORLD.md"),
                encoding="utf-8").read()
    assert expected["clip.pt"] in docs, "docs/TOYWORLD.md does not state the shipped model's SHA-256"


SHIPPED = os.path.join(pretrain.SHIPPED_FOLDER, "full")  # the repository's, before any test points elsewhere


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """A copy of the shipped folder that the code is pointed at (so a test may damage it)."""
    folder = tmp_path / "assets"
    shutil.copytree(pretrain.SHIPPED_FOLDER, folder)
    monkeypatch.setattr(pretrain, "SHIPPED_FOLDER", str(folder))
    return folder / "full"


def test_an_altered_or_missing_shipped_file_is_a_one_line_error_not_another_model(shipped_copy, tmp_path):
    with open(shipped_copy / "clip.pt", "r+b") as f:  # one byte of one tensor
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(clip_model.CLIPFileError, match=r"clip\.pt: SHA-256 .* is not the shipped file's"):
        pretrain.pretrained_clip(pretrain.CONFIGS["full"], str(tmp_path), log=lambda line: None)
    shutil.copy(os.path.join(SHIPPED, "clip.pt"), shipped_copy / "clip.pt")  # restored
    os.remove(shipped_copy / "bpe.txt.gz")
    with pytest.raises(clip_model.CLIPFileError, match=r"bpe\.txt\.gz: missing.*--rebuild"):
        pretrain.pretrained_clip(pretrain.CONFIGS["full"], str(tmp_path), log=lambda line: None)


def test_a_shipped_model_of_other_settings_is_not_used(shipped_copy, monkeypatch):
    """Changed settings (here the step budget) mean the shipped model is not theirs: None, so
    the caller builds, as for a scale that ships nothing."""
    lines = []
    other = pretrain.replace(pretrain.CONFIGS["full"], max_steps=3000)
    assert pretrain.shipped_clip(other, log=lines.append) is None
    assert any("made with other settings" in line for line in lines)
    assert pretrain.shipped_clip(pretrain.CONFIGS["miniature"], log=lines.append) is None  # none shipped
    assert pretrain.shipped_clip(pretrain.CONFIGS["full"], log=lines.append) is not None


def test_compare_with_shipped_tells_the_same_model_from_another(shipped_copy, tmp_path):
    """What `python -m toyworld --rebuild` reports: a build with the shipped bytes is "bit for
    bit"; one weight moved by one ULP is another model, and the line says how many tensors and
    by how much."""
    model, _ = clip_model.load(str(shipped_copy / "clip.pt"))
    clip_model.save(model, str(tmp_path / "clip.pt"))  # the same tensors, saved again
    build = (str(tmp_path / "clip.pt"), str(shipped_copy / "bpe.txt.gz"), "full")
    assert "bit for bit" in pretrain.compare_with_shipped(*build)
    with torch.no_grad():
        weight = model.visual.proj
        weight[0, 0] = torch.nextafter(weight[0, 0], weight[0, 0] + 1)
    clip_model.save(model, str(tmp_path / "clip.pt"))
    line = pretrain.compare_with_shipped(*build)
    assert line.startswith("the build is another model: 1 of ") and "by up to" in line, line
