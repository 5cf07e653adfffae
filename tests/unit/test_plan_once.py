"""A run reads its inputs' footers, its eval sets and its corpus once: the preflight's enrichment plan (made before
Ray or Spark start, so a bad input fails in seconds) is the one the enrichment uses. Spark is replaced by a fake
session here: what is checked is which plan reaches the job, not the enrichment."""

from contextlib import contextmanager

from raytrain import runner
from raytrain.config import load_job_config
from raytrain.enrich import inputs, job, plan
from raytrain.sample_data import write_sample_dataset
from raytrain.storage import resolve


def test_the_enrichment_uses_the_plan_preflight_made(tmp_path, monkeypatch):
    write_sample_dataset(str(tmp_path / "in"), rows_per_split=20)
    cfg = load_job_config("configs/demo.yaml", [f"input.path={tmp_path / 'in'}", f"storage.root={tmp_path / 'runs'}",
                                                "storage.user=me", "enrich.eval_sets=[sample]", "enrich.context_corpus=[]"])
    run = runner.Run(job=cfg, root=resolve(str(tmp_path / "runs" / "me" / "demo" / "r")), user="me")
    discovered = []
    real_discover = inputs.discover_inputs
    monkeypatch.setattr(plan, "discover_inputs", lambda *a: discovered.append(a) or real_discover(*a))
    monkeypatch.setattr("raytrain.enrich.spark.find_java", lambda: "java")
    runner.preflight(run)
    assert len(discovered) == 1

    used = []

    @contextmanager
    def no_spark(*args, **kwargs):
        yield "spark"

    monkeypatch.setattr("raytrain.enrich.spark.spark_session", no_spark)
    monkeypatch.setattr(job, "enrich_in_session", lambda spark, j, i, r, plan, on_wave: used.append(plan) or "result")
    early = runner._PLANS[(run.root.uri, cfg.config_hash())]
    input_root = runner.stage_input(run)
    got = job.run_enrich(cfg, input_root, run.root, eval_sets=runner.eval_set_paths(run, input_root),
                         plan=runner._PLANS.pop((run.root.uri, cfg.config_hash())))
    assert got == "result" and used == [early] and len(discovered) == 1
    assert set(early.footers) == set(cfg.input.splits) and early.evals.texts and early.rows_in > 0
