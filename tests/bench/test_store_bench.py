"""`luftpause bench store`: both stores measured, on a real PostgreSQL server, and the record written."""

import json

from luftpause.bench import store


def test_the_store_benchmark_measures_both_stores_and_records_them(tmp_path, postgres_url, capsys):
    assert store.main(["--seconds", "0.3", "--spawners", "2", "--writers", "2", "--url", postgres_url,
                       "--out", str(tmp_path)]) == 0  # fmt: skip
    (record,) = tmp_path.glob("store-*.json")
    rows = json.loads(record.read_text())["stores"]
    assert set(rows) == {"file", "postgresql"}
    for r in rows.values():
        assert r["spawns"] > 0 and r["writes"] > 0
        assert 0 < r["spawn_p50_ms"] <= r["spawn_p99_ms"] and 0 < r["write_p50_ms"] <= r["write_p99_ms"]
    assert (
        "| postgresql |" in capsys.readouterr().out
        and "| postgresql |" in record.with_suffix(".md").read_text()
    )
