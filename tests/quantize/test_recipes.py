"""Recipe files: the shipped ones, the user-file path, pattern semantics and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.errors import UsageError
from eagle3.quantize.recipes import builtin_names, load_recipe, match, parse_recipe

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def test_shipped_recipes() -> None:
    assert builtin_names() == ["fp8-draft", "int4-draft", "mxfp4", "w4a8", "w4a8-int8"]
    w4a8 = load_recipe("w4a8")
    assert (w4a8.weight.format, w4a8.activation.format, w4a8.activation.qscheme) == ("fp8_int4", "fp8", "per_tensor")
    assert not w4a8.export.zero_point
    # The exact exclude list of AMD's Kimi-K2.5-W4A8 script.
    assert list(w4a8.scope().exclude) == ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj",
                                          "*mlp.down_proj", "*shared_experts*", "*mm_projector*", "*vision_tower*"]
    assert load_recipe("w4a8-int8").activation.format == "int8"
    mx = load_recipe("mxfp4")
    assert mx.default_scope == "experts+shared+dense" and set(mx.scopes) == {"experts", "experts+shared+dense"}
    assert load_recipe("int4-draft").export.zero_point


@pytest.mark.parametrize("module, scope, want", [
    ("language_model.model.layers.3.mlp.experts.7.down_proj", "experts", True),
    ("model.layers.3.mlp.shared_experts.up_proj", "experts", False),
    ("model.layers.3.mlp.shared_experts.up_proj", "experts+shared+dense", True),
    ("language_model.model.layers.0.mlp.gate_proj", "experts+shared+dense", True),
    ("language_model.model.layers.3.mlp.gate", "experts+shared+dense", False),  # the router
    ("language_model.model.layers.3.self_attn.q_a_proj", "experts+shared+dense", False),
    ("vision_tower.encoder.blocks.0.mlp.fc0", "experts+shared+dense", False),
    ("language_model.lm_head", "experts+shared+dense", False),
])
def test_mxfp4_scopes(module: str, scope: str, want: bool) -> None:
    assert load_recipe("mxfp4").scope(scope).matches(module) is want


@pytest.mark.parametrize("module, want", [
    ("midlayer.self_attn.q_proj", True), ("layers.0.mlp.down_proj", True),
    ("layers.0.self_attn.kv_a_proj_with_mqa", True), ("layers.0.self_attn.q_b_proj", True),
    ("fc", False), ("lm_head", False), ("midlayer.hidden_norm", False), ("embed_tokens", False),
])
def test_int4_draft_scope(module: str, want: bool) -> None:
    assert load_recipe("int4-draft").scope().matches(module) is want


def test_pattern_semantics() -> None:
    assert match("*mlp.gate", "model.layers.1.mlp.gate") and not match("*mlp.gate", "model.layers.1.mlp.gate_proj")
    assert match("re:mlp\\.gate$", "model.layers.1.mlp.gate")  # re.search: anywhere in the name
    assert not match("MLP*", "mlp.x")  # globs are case-sensitive


def test_user_recipe_from_a_path(tmp_path: Path) -> None:
    f = tmp_path / "mine.yaml"
    f.write_text("name: mine\nweight: {format: int4, qscheme: per_group, group_size: 128}\n"
                 "scope: {include: ['*mlp.*'], exclude_regex: ['re:.*lm_head$']}\n")
    r = load_recipe(f)
    assert (r.name, r.weight.group_size, r.weight.k_multiple, r.export.zero_point) == ("mine", 128, 128, True)
    assert r.scope().name == "default" and r.scope().exclude_regex == ("re:.*lm_head$",)


def test_the_documented_example_recipe_parses() -> None:
    text = DOC.read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    r = parse_recipe(text, str(DOC))
    assert r.name == "int4-g128-mlp" and r.scope().matches("model.layers.0.mlp.gate_proj")


@pytest.mark.parametrize("yaml_text, field", [
    ("weight: {format: int4}\nscope: {include: ['*']}\n", "'name'"),
    ("name: x\nweight: {format: int3}\nscope: {include: ['*']}\n", "'weight.format'"),
    ("name: x\nweight: {format: int4, qscheme: per_group, group_size: 48}\nscope: {include: ['*']}\n",
     "'weight.group_size'"),
    ("name: x\nweight: {format: mxfp4}\nactivation: {format: fp8, qscheme: per_group}\nscope: {include: ['*']}\n",
     "'activation.qscheme'"),
    ("name: x\nweight: {format: int4}\nactivation: {format: mxfp4}\nscope: {include: ['*']}\n", "'activation.format'"),
    ("name: x\nweight: {format: fp8}\nscope: {include: []}\n", "'scope.include'"),
    ("name: x\nweight: {format: fp8}\nscope: {include: ['re:(']}\n", "bad regex"),
    ("name: x\nweight: {format: fp8}\nscope: {include: ['*'], exclude_regex: ['lm_head']}\n", "'scope.exclude_regex'"),
    ("name: x\nweight: {format: fp8}\n", "'scopes'"),
    ("name: x\nweight: {format: fp8}\nscope: {include: ['*']}\nexport: {zero_point: true}\n", "'export.zero_point'"),
    ("name: x\nweights: {format: fp8}\nscope: {include: ['*']}\n", "'weights'"),
    ("name: x\nweight: {format: fp8}\nscope: {include: ['*']}\nactivation: {format: fp8, dynamic: false}\n",
     "'activation'"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_bad_recipes_are_one_line_errors_naming_the_field(yaml_text: str, field: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_recipe(yaml_text, "my.yaml")
    msg = str(e.value)
    assert msg.startswith("my.yaml: ") and field in msg and "\n" not in msg


def test_unknown_recipe_and_scope() -> None:
    with pytest.raises(UsageError, match="no built-in recipe of that name"):
        load_recipe("w3a7")
    with pytest.raises(UsageError, match="unknown scope 'dense'"):
        load_recipe("mxfp4").scope("dense")
