"""The config file: embedded defaults, and errors that name the file, the key and the problem."""

from pathlib import Path

import pytest

from luftpause import config


def test_no_file_gives_the_embedded_stack() -> None:
    conf = config.load(None)
    assert [r.name for r in conf.replicas] == ["fake-a", "fake-b"]
    assert [r.url for r in conf.replicas] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert conf.scheduler.grpc_port == 5000 and conf.scheduler.status_port == 5001
    assert conf.dataplane.port == 8080 and conf.runtime.port == 7000
    assert conf.runtime.mcp_servers[0].url == "http://127.0.0.1:9100/mcp"


def test_a_file_overrides_sections(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[dataplane]\nport = 18080\n\n[[replicas]]\nname = "gpu-0"\nurl = "https://pod.example/v1"\n'
        'models = ["llama-3.3-70b"]\napi_key_env = "POD_KEY"\nmetrics = "vllm"\n'
    )
    conf = config.load(f)
    assert conf.dataplane.port == 18080
    assert conf.scheduler.grpc_port == 5000
    (replica,) = conf.replicas
    assert replica.metrics == "vllm" and replica.api_key_env == "POD_KEY"


def test_engine_priority_is_off_unless_a_replica_declares_its_engines_convention(tmp_path: Path) -> None:
    assert {r.engine_priority for r in config.load(None).replicas} == {"none"}
    f = tmp_path / "c.toml"
    f.write_text(
        '[[replicas]]\nname = "gpu-0"\nurl = "http://gpu:30000"\nmodels = ["m"]\nengine_priority = "sglang"\n'
    )
    assert config.load(f).replicas[0].engine_priority == "sglang"


def test_stream_usage_is_asked_unless_a_replica_opts_out(tmp_path: Path) -> None:
    assert {r.stream_usage for r in config.load(None).replicas} == {True}
    f = tmp_path / "c.toml"
    f.write_text(
        '[[replicas]]\nname = "ollama"\nurl = "http://o:11434"\nmodels = ["m"]\nstream_usage = false\n'
    )
    assert config.load(f).replicas[0].stream_usage is False


def test_lookahead_is_two_unless_a_replica_sets_it(tmp_path: Path) -> None:
    assert {r.lookahead for r in config.load(None).replicas} == {2}
    f = tmp_path / "c.toml"
    f.write_text('[[replicas]]\nname = "hosted"\nurl = "https://api"\nmodels = ["m"]\nlookahead = 0\n')
    assert config.load(f).replicas[0].lookahead == 0


def test_a_single_pass_replica_takes_every_turn_unless_it_sets_a_lookahead(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    one = '[[replicas]]\nname = "{name}"\nurl = "http://x"\nkind = "single-pass"\nmodels = ["m"]\n'
    f.write_text(one.format(name="classifier") + one.format(name="capped") + "lookahead = 3\n")
    assert [r.lookahead for r in config.load(f).replicas] == [0, 3]


def test_api_key_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    replica = config.Replica(name="r", url="https://x", models=["m"], api_key_env="LP_TEST_KEY")
    monkeypatch.delenv("LP_TEST_KEY", raising=False)
    assert replica.api_key() is None
    monkeypatch.setenv("LP_TEST_KEY", "sk-1")
    assert replica.api_key() == "sk-1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[dataplane]\nprot = 1\n", "dataplane.prot"),
        ('[[replicas]]\nname = "a"\nurl = "ftp://x"\nmodels = ["m"]\n', "replicas.0.url"),
        ('[[replicas]]\nname = "a"\nurl = "http://x"\nmodels = []\n', "replicas.0.models"),
        (
            '[[replicas]]\nname = "a"\nurl = "http://x"\nmodels = ["m"]\n'
            '[[replicas]]\nname = "a"\nurl = "http://y"\nmodels = ["m"]\n',
            "repeated: a",
        ),
        (
            '[[replicas]]\nname = "r"\nurl = "http://x"\nmodels = ["m"]\nload_from = ["nope"]\n',
            "unknown replicas",
        ),
        ('[[runtime.mcp_servers]]\nname = "t"\n', "exactly one of url"),
        (
            '[[replicas]]\nname = "a"\nurl = "http://x"\nmodels = ["m"]\nengine_priority = "higher"\n',
            "replicas.0.engine_priority: Input should be 'none', 'sglang' or 'vllm'",
        ),
        (
            '[[replicas]]\nname = "a"\nurl = "http://x"\nmodels = ["m"]\nlookahead = -1\n',
            "replicas.0.lookahead: Input should be greater than or equal to 0",
        ),
        (
            '[runtime]\nstore = "mysql://db/runs"\n',
            "runtime.store: Value error, store 'mysql://db/runs' is neither \"file\"",
        ),
        ("[runtime]\nlease_s = 0.5\n", "runtime.lease_s: Input should be greater than or equal to 1"),
        ("[dataplane\n", "not valid TOML"),
    ],
)
def test_bad_files_name_file_key_and_problem(tmp_path: Path, text: str, expected: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        config.load(f)
    assert str(f) in str(err.value)
    assert expected in str(err.value)


def test_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="no such file"):
        config.load(tmp_path / "absent.toml")


def test_strings_take_variables_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[[replicas]]\nname = "pod"\nurl = "https://${LP_TEST_POD}-8000.example"\n'
        'models = ["${LP_TEST_MODEL:-llama3.2:1b}"]\n'
    )
    monkeypatch.setenv("LP_TEST_POD", "abc123")
    monkeypatch.delenv("LP_TEST_MODEL", raising=False)
    (replica,) = config.load(f).replicas
    assert replica.url == "https://abc123-8000.example" and replica.models == ["llama3.2:1b"]
    monkeypatch.setenv("LP_TEST_MODEL", "qwen2.5:3b")
    assert config.load(f).replicas[0].models == ["qwen2.5:3b"]


def test_an_unset_variable_without_default_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[replicas]]\nname = "pod"\nurl = "https://${LP_TEST_UNSET}.example"\nmodels = ["m"]\n')
    monkeypatch.delenv("LP_TEST_UNSET", raising=False)
    with pytest.raises(config.ConfigError) as e:
        config.load(f)
    assert str(f) in str(e.value) and "replicas.0.url" in str(e.value) and "LP_TEST_UNSET" in str(e.value)
