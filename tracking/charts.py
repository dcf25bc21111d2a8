"""How monim's runs look in MLflow: a day's metrics named in sections (MLflow charts a run's metrics
by the prefix before "/", the sections in alphabetical order, so the numbers a comparison is read by
come first: `1_results` holds what each run achieved so far (PPL over all its test tokens and on novel
articles, QA, MemRate in percent and the memory's MB as the terminal shows them, learning and
scoring seconds), the day's own PPL is in `3_quality`), and the
experiment's saved view (its runs table shows those columns, its charts the stream's dates). Runs
records and the report keep the plain names (`ppl`); names logged before sections (plain ones) are
read back as they are."""

from __future__ import annotations

import json
import time

SECTIONS = (  # a name ending in "_" or "/" takes every metric that starts with it
    # what each run achieved over its days so far (monim.evaluation.totals.so_far; QA from the evaluation suite)
    ("1_results", ("ppl_so_far", "ppl_novel_so_far", "qa_accuracy_0shot", "memrate_percent", "memory_mb",
                   "seconds_learn_so_far", "seconds_score_per_1k_so_far", "lm_tokens_per_token_so_far", "accuracy_so_far")),
    ("2_learned", ("entries", "memrate", "memory_bytes", "memrate_day", "entries_stored", "tokens_seen", "index_recall", "tokens_trained",
                   "review_tokens", "steps", "train_loss")),
    ("3_quality", ("ppl", "ppl_lm", "accuracy", "accuracy_lm", "ppl_novel", "ppl_lm_novel", "twin_share", "skipped",
                   "tokens")),
    ("4_suite", ("ppl_period/", "accuracy_period/", "ppl_text", "ppl_text_lm", "qa_")),
    ("5_calibration", ("lam", "lam_copy", "temperature", "theta_", "heldout_", "calibration_", "calibrator_seconds")),
    ("6_cost", ("seconds_", "tokens_per_s", "decision_", "tokens_featurized", "featurize_workers", "evaluate_seconds",
                "ralm_seconds", "lm_tokens_per_token")),
    ("7_registry", ("model_version", "registered", "champion_moved", "gate_")),
    ("8_data", ("docs_",)),
)
OTHER = "9_other"
NOT_LOGGED = ("date", "policy", "step")  # a row's fields that are no metric (the step is MLflow's own axis)


def chart_name(key: str) -> str:
    """The MLflow name of a row's metric: its section, then its name."""
    for section, names in SECTIONS:
        if any(key == n or n.endswith(("_", "/")) and key.startswith(n) for n in names):
            return f"{section}/{key}"
    return f"{OTHER}/{key}"


def row_key(name: str) -> str:
    """A row's key from an MLflow name (a name logged before sections is its own key)."""
    section, _, rest = name.partition("/")
    return rest if rest and section in {s for s, _ in SECTIONS} | {OTHER} else name


VIEW = "monim"  # the saved view's key: MLflow's UI opens it with ?viewStateShareKey=monim
VIEW_TAG = f"mlflow.sharedViewState.{VIEW}"  # where MLflow's "Share" button keeps a view: an experiment tag


def saved_view() -> str:
    """The experiment's saved view, as MLflow's UI stores one: the runs table with each run's
    duration and the results section's columns, in order and wide enough to read; charts over the
    stream's dates (the metrics' times)."""
    metrics = [f"metrics.`{chart_name(k)}`" for k in SECTIONS[0][1]]
    # the grid names the duration column by its field, not by its selection key
    state = {"selectedColumns": ["attributes.`Duration`", *metrics], "columnOrder": ["duration", *metrics],
             "columnWidths": {c: 150 for c in metrics},
             "hideEmptyCharts": True, "useGroupedValuesInCharts": True,
             "globalLineChartConfig": {"xAxisKey": "time", "lineSmoothness": 0, "selectedXAxisMetricKey": ""}}
    now = int(time.time() * 1000)
    return json.dumps({"name": "monim: results by day", "createdAt": now, "updatedAt": now, "state": json.dumps(state)})
