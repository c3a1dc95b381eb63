"""A generative model's own config: `platform: "onnxruntime_decoder"` in Triton's model config marks it, its
`parameters` override the agent's `generation` settings, `dynamic_batching` gives its levels and each level's default
first-token timeout and queue cap; mistakes are refused at load naming the file and the key."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest

from edge_agent.config import GenerationSettings
from edge_agent.generation.load import load_engine
from edge_agent.runtime.config import ModelConfigError
from edge_agent.runtime.repository import generative_models, load_repository
from spillway.demo.tiny_lm import TINY, build_tiny_lm_version

FREE = 8 << 30

DECODER = """
platform: "onnxruntime_decoder"
parameters { key: "max_num_seqs" value { string_value: "3" } }
parameters { key: "queue_policy" value { string_value: "shortest_prompt_first" } }
parameters { key: "aging_s" value { string_value: "2.5" } }
parameters { key: "default_max_tokens" value { string_value: "40" } }
dynamic_batching {
  priority_levels: 2
  default_priority_level: 2
  priority_queue_policy { key: 1 value { default_timeout_microseconds: 200000 allow_timeout_override: true } }
  priority_queue_policy { key: 2 value { max_queue_size: 5 } }
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm_version(tmp_path_factory.mktemp("lm") / "tiny-lm", 1, TINY).parent


def _repository(tmp_path: Path, built: Path, config: str | None, name: str = "config.pbtxt") -> Path:
    model = tmp_path / "repo" / "chat"
    shutil.copytree(built, model)
    if config is not None:
        (model / name).write_text(config)
    return tmp_path / "repo"


def test_a_decoder_config_marks_the_model_generative_and_overrides_the_agents_settings(
    tmp_path: Path, built: Path
) -> None:
    root = _repository(tmp_path, built, DECODER)
    assert load_repository(root).models == {}  # not a V2 model
    (found,) = generative_models(root).values()
    assert found.config is not None and found.folder.name == "1"
    pool = load_engine("chat", found.folder, GenerationSettings(max_num_seqs=8), model=found.config, free_bytes=FREE)
    engine = pool.instances[0]
    try:
        config = engine.scheduler.config
        assert (config.max_num_seqs, config.queue_policy, config.aging_s) == (3, "shortest_prompt_first", 2.5)
        assert (config.levels, config.default_level) == (2, 2)
        assert config.max_num_batched_tokens == GenerationSettings().max_num_batched_tokens  # the agent's
        assert engine.scheduler.deadline_for(1, 0.0, None) == pytest.approx(0.2)
        assert engine.scheduler.deadline_for(2, 0.0, None) is None
        assert config.level_policy(2).max_queue_size == 5
        assert pool.default_max_tokens == 40  # a chat request without max_tokens gets the model's default
    finally:
        pool.close()


def test_instance_group_count_gives_that_many_engines_sharing_the_kv_budget(tmp_path: Path, built: Path) -> None:
    config = 'platform: "onnxruntime_decoder"\ninstance_group [{ count: 2 kind: KIND_CPU }]'
    (found,) = generative_models(_repository(tmp_path, built, config)).values()
    one = load_engine("chat", found.folder, GenerationSettings(kv_budget_bytes=8 << 20), free_bytes=FREE)
    two = load_engine("chat", found.folder, GenerationSettings(kv_budget_bytes=8 << 20), model=found.config,
                      free_bytes=FREE)  # fmt: skip
    try:
        assert len(one.instances) == 1 and len(two.instances) == 2
        blocks = [engine.scheduler.blocks.total for engine in two.instances]
        assert blocks[0] == blocks[1] and sum(blocks) <= one.instances[0].scheduler.blocks.total
        assert two.json()["kv_blocks"]["total"] == sum(blocks) and two.json()["instances"] == 2
        assert {e.runner.session.get_providers()[0] for e in two.instances} == {"CPUExecutionProvider"}
    finally:
        one.close()
        two.close()


def test_dynamic_batching_without_levels_gives_its_default_queue_policy_to_every_level(
    tmp_path: Path, built: Path
) -> None:
    config = ('platform: "onnxruntime_decoder"\ndynamic_batching { default_queue_policy { '
              "default_timeout_microseconds: 300000 max_queue_size: 7 } }")  # fmt: skip
    (found,) = generative_models(_repository(tmp_path, built, config)).values()
    pool = load_engine("chat", found.folder, GenerationSettings(levels=3), model=found.config, free_bytes=FREE)
    try:
        scheduler = pool.instances[0].scheduler
        for level in (1, 2, 3):
            assert scheduler.config.level_policy(level).max_queue_size == 7
            assert scheduler.deadline_for(level, 0.0, None) == pytest.approx(0.3)
    finally:
        pool.close()


def test_a_model_without_a_config_is_generative_with_the_agents_settings(tmp_path: Path, built: Path) -> None:
    (found,) = generative_models(_repository(tmp_path, built, None)).values()
    assert found.config is None
    pool = load_engine("chat", found.folder, GenerationSettings(queue_policy="fcfs"), free_bytes=FREE)
    try:
        (engine,) = pool.instances
        assert engine.scheduler.config.queue_policy == "fcfs" and engine.scheduler.config.levels == 3
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('platform: "onnxruntime_decoder"\nparameters { key: "max_num_seq" value { string_value: "3" } }',
         r"config.pbtxt: parameters\['max_num_seq'\]: not a generation setting; did you mean 'max_num_seqs'"),
        ('platform: "onnxruntime_decoder"\nparameters { key: "max_num_seqs" value { string_value: "many" } }',
         r"config.pbtxt: parameters\['max_num_seqs'\]: .*integer"),
        ('platform: "onnxruntime_decoder"\nparameters { key: "queue_policy" value { string_value: "lifo" } }',
         r"parameters\['queue_policy'\]: .*'priority', 'fcfs' or 'shortest_prompt_first'"),
        ('platform: "onnxruntime_decoder"\nparameters { key: "levels" value { string_value: "4" } }\n'
         "dynamic_batching { priority_levels: 2 default_priority_level: 1 }",
         r"parameters\['levels'\]: dynamic_batching.priority_levels sets the levels already"),
    ],
)  # fmt: skip
def test_a_bad_generation_parameter_is_refused_naming_the_file_and_key(
    tmp_path: Path, built: Path, config: str, message: str
) -> None:
    (found,) = generative_models(_repository(tmp_path, built, config)).values()
    with pytest.raises(ModelConfigError, match=message):
        load_engine("chat", found.folder, GenerationSettings(), model=found.config, free_bytes=FREE)


def test_a_decoder_config_with_tensors_or_a_version_without_genai_config_is_refused(
    tmp_path: Path, built: Path
) -> None:
    tensors = 'platform: "onnxruntime_decoder"\ninput [{ name: "input_ids" data_type: TYPE_INT64 dims: [-1] }]'
    with pytest.raises(ModelConfigError, match=r"field 'input': .*genai_config.json"):
        generative_models(_repository(tmp_path / "a", built, tensors))
    root = _repository(tmp_path / "b", built, 'platform: "onnxruntime_decoder"')
    (root / "chat" / "2").mkdir()
    with pytest.raises(ModelConfigError, match=r"chat/2/genai_config.json: missing"):
        generative_models(root)
    yaml_root = _repository(tmp_path / "c", built, "platform: onnxruntime_decoder\n", name="config.yaml")
    assert list(generative_models(yaml_root)) == ["chat"]


def test_the_docs_decoder_config_loads_and_every_generation_setting_is_documented(tmp_path: Path, built: Path) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "agent" / "generative.md").read_text()
    found_block = re.search(r'```pbtxt\n( *platform: "onnxruntime_decoder"\n.*?)```', page, re.DOTALL)
    assert found_block is not None
    snippet = textwrap.dedent(found_block.group(1))
    (found,) = generative_models(_repository(tmp_path, built, snippet)).values()
    pool = load_engine("chat", found.folder, GenerationSettings(), model=found.config, free_bytes=FREE)
    try:
        assert pool.instances[0].scheduler.deadline_for(1, 0.0, None) == pytest.approx(0.5)
    finally:
        pool.close()
    missing = [key for key in GenerationSettings.model_fields if f"`{key}`" not in page]
    assert missing == []


def test_the_version_policy_picks_the_served_version_and_the_demo_serves_tiny_lm_v1(tmp_path: Path) -> None:
    from spillway.demo.models import build_demo_repository

    root = build_demo_repository(tmp_path / "demo")
    chosen = generative_models(root)["tiny-lm"]
    assert chosen.folder.name == "1" and chosen.config is not None  # v2, the lite one, is on disk beside it
    assert (root / "tiny-lm" / "2" / "genai_config.json").is_file()
    latest = 'platform: "onnxruntime_decoder"\nversion_policy { latest { num_versions: 1 } }'
    (root / "tiny-lm" / "config.pbtxt").write_text(latest)
    assert generative_models(root)["tiny-lm"].folder.name == "2"


def test_a_kv_budget_whose_working_copies_do_not_fit_the_free_memory_is_refused(tmp_path: Path, built: Path) -> None:
    (found,) = generative_models(_repository(tmp_path, built, None)).values()
    settings = GenerationSettings(kv_budget_bytes=64 << 20)
    with pytest.raises(ModelConfigError, match=r"needs about 3x that while decoding .* more than the free memory"):
        load_engine("chat", found.folder, settings, free_bytes=100 << 20)  # 64 MiB of blocks, 192 MiB to decode
    load_engine("chat", found.folder, settings, free_bytes=200 << 20).close()  # fits
