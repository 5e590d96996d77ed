"""Which backend computes a candidate's declared formula (harness/emulating.py). Why: with `-r jax` the Keras
Adam candidates' declared formula (adam_eps_hat+adam_float32_betas) was asked of jax, whose wrapper does not
compute it: the resync job failed and every such pair ended INCONCLUSIVE ("a resync job failed (fault ... is
not implemented in this backend's wrapper)"). Now a backend that computes it does, from the reference's states,
or the note says which reference would verify it."""
from __future__ import annotations

from types import SimpleNamespace

from algorithms.contract import RunOptions
from harness.emulating import computes, emulating_backend, emulation

INFO = {
    "torch": {"missing": [], "faults": ["adam_eps_hat"], "capabilities": ["data_parallel", "float64", "threads"],
              "emulations": ["adam_eps_hat", "adam_float32_betas", "bn_running_var_biased", "bn_replica_mean_running_stats"],
              "no_data_parallel": ""},
    "jax": {"missing": [], "faults": ["adam_eps_hat"], "capabilities": ["data_parallel", "float64", "sync_bn"],
            "emulations": ["bn_running_var_biased"], "no_data_parallel": ""},
    "numpy": {"missing": [], "faults": [], "capabilities": ["float64"], "emulations": [],
              "no_data_parallel": "one process"},
    "keras-jax": {"missing": [], "faults": [], "capabilities": ["data_parallel", "float64"], "emulations": [],
                  "no_data_parallel": "", "replica_running_stats": "global"},
    "tensorflow": {"missing": [], "faults": ["adam_eps_hat"], "capabilities": ["data_parallel", "float64", "sync_bn"],
                   "emulations": ["bn_running_var_biased"], "no_data_parallel": "", "replica_running_stats": "mean"},
}
KERAS_ADAM = [{"id": "adam_epsilon_hat"}, {"id": "keras_float32_betas"}]


def _run(backend: str, declared=(), fault=None, batchnorm="", **options) -> SimpleNamespace:
    return SimpleNamespace(backend=backend, declared=[{"id": d} if isinstance(d, str) else d for d in declared],
                           fault=fault, manifest={"parallel": {"batchnorm": batchnorm}}, options=RunOptions(**options))


def test_a_backend_computes_its_own_faults_alone_and_its_emulations_joined():
    assert computes(INFO["torch"], "adam_eps_hat+adam_float32_betas")
    assert computes(INFO["jax"], "adam_eps_hat")                      # a catalogued fault, alone
    assert not computes(INFO["jax"], "adam_eps_hat+adam_float32_betas")
    assert not computes(INFO["numpy"], "bn_running_var_biased")


def test_another_backend_computes_the_formula_with_the_references_step_not_its_way_of_running_it():
    adam = ["adam_eps_hat", "adam_float32_betas"]
    assert emulating_backend(_run("torch"), adam, INFO) == ({"fault": "adam_eps_hat+adam_float32_betas"}, "")
    change, why = emulating_backend(_run("jax"), adam, INFO)
    assert change == {"backend": "torch", "fault": "adam_eps_hat+adam_float32_betas"}
    assert why == ("the reference's backend jax does not compute adam_eps_hat+adam_float32_betas: torch computes it "
                   "from the reference's states")
    # eager, two threads, two processes standing in for hosts: how the step runs, left at the defaults
    change, _ = emulating_backend(_run("jax", jit=False, threads=2, extra={"hosts": 2}), ["adam_float32_betas"], INFO)
    assert change == {"backend": "torch", "fault": "adam_float32_betas", "jit": True, "threads": 1, "extra": {}}
    # synchronized BatchNorm changes the step: jax computes Keras' running variance itself; torch cannot run it
    sync = _run("jax", devices=2, extra={"sync_bn": True})
    assert emulating_backend(sync, ["bn_running_var_biased"], INFO) == ({"fault": "bn_running_var_biased"}, "")
    none, why = emulating_backend(sync, ["adam_float32_betas"], INFO)
    assert none is None and why == ("the reference's backend jax does not compute adam_float32_betas, and torch, "
                                    "which do, cannot run the reference's configuration (a torch run as the "
                                    "reference would verify it: -r torch)")
    none, why = emulating_backend(_run("jax"), ["avgpool_replicate_pad"], INFO)
    assert none is None and why.endswith("and no installed backend does")


def test_the_emulation_of_a_declared_difference_names_the_backend_that_computes_it():
    got = emulation(_run("jax"), _run("keras-jax", declared=KERAS_ADAM), INFO)
    assert got["change"] == {"backend": "torch", "fault": "adam_eps_hat+adam_float32_betas"}
    assert got["check"]["emulated"] == ["adam_epsilon_hat", "keras_float32_betas"]
    assert "torch computes it from the reference's states" in got["check"]["emulated_on"]
    assert "skipped" not in got["check"]
    # the reference's own backend computes it: nothing changes but the fault
    own = emulation(_run("torch"), _run("keras-jax", declared=KERAS_ADAM), INFO)
    assert own["change"] == {"fault": "adam_eps_hat+adam_float32_betas"} and "emulated_on" not in own["check"]
    # none can: not emulated, and the check says why (its pairs are never DECLARED without that evidence)
    sync = emulation(_run("jax", devices=2, extra={"sync_bn": True}),
                     _run("keras-jax", declared=KERAS_ADAM, devices=2), INFO)
    assert sync["change"] is None and sync["check"]["emulated"] == []
    assert sync["check"]["skipped_differences"] == ["adam_epsilon_hat", "keras_float32_betas"]
    assert "-r torch" in sync["check"]["skipped"]


PER_REPLICA = "per_replica_batchnorm"
MEAN = "per replica; running statistics = MEAN over replicas"


def test_a_data_parallel_reference_with_per_replica_statistics():
    """Found as a user (session 28): resnet_tiny at --devices 2 in every backend compared with torch --devices 2.
    keras-jax (one program over the sharded batch: global statistics, no per-replica declaration) was DECLARED
    "not verified" on the reference's own declaration, its step-0 BatchNorm forward 30x off; keras-tensorflow
    (per replica, as torch) was skipped as 'declared by the reference run itself' and DECLARED unverified too."""
    ref = _run("torch", [PER_REPLICA], devices=2)
    # global statistics against the reference's per-replica ones: the reference on one device computes them
    glob = emulation(ref, _run("keras-jax", KERAS_ADAM, devices=2), INFO)
    assert glob["change"] == {"devices": 1, "fault": "adam_eps_hat+adam_float32_betas"}
    assert glob["check"]["emulated"] == ["adam_epsilon_hat", "keras_float32_betas", PER_REPLICA]
    assert "skipped" not in glob["check"] and glob["check"]["same"] == []
    # per replica on both sides, the same replica count, the same running statistics: no difference between them,
    # nothing emulated and nothing a disagreement may be set aside for
    same = emulation(ref, _run("jax", [PER_REPLICA], devices=2), INFO)
    assert same["change"] is None and same["check"]["same"] == [PER_REPLICA] and "skipped" not in same["check"]
    # per replica on both, the candidate's running statistics the MEAN of its replicas': emulated as usual
    mean = emulation(ref, _run("keras-tensorflow", KERAS_ADAM + [PER_REPLICA], batchnorm=MEAN, devices=2), INFO)
    assert mean["change"] == {"devices": 2, "fault": "adam_eps_hat+adam_float32_betas+bn_replica_mean_running_stats"}
    assert PER_REPLICA in mean["check"]["emulated"] and mean["check"]["same"] == []
    # another replica count: the reference at the candidate's
    four = emulation(ref, _run("jax", [PER_REPLICA], devices=4), INFO)
    assert four["change"] == {"devices": 4} and four["check"]["emulated"] == [PER_REPLICA]
    # the reference folds the MEAN of its replicas', the candidate keeps replica 0's: nothing undoes that
    folded = emulation(_run("tensorflow", [PER_REPLICA], batchnorm=MEAN, devices=2), _run("torch", [PER_REPLICA],
                                                                                         devices=2), INFO)
    assert folded["check"]["skipped_differences"] == [PER_REPLICA] and folded["change"] is None


def test_per_replica_statistics_are_emulated_by_a_backend_that_folds_them_as_the_candidate():
    """Found with `-r tensorflow` (session 28): torch, jax and numpy at --devices 2 (replica 0's running statistics)
    were BUG at `forward: bn1 running statistics` against tensorflow at --devices 2 computing their formula, since
    tf.distribute keeps the MEAN of its replicas' (rel 2e-3 at step 0)."""
    tf = _run("tensorflow")
    replica0 = emulation(tf, _run("torch", [PER_REPLICA], devices=2), INFO)
    assert replica0["change"] == {"devices": 2, "backend": "jax"}, replica0    # not the candidate's own backend
    assert "jax computes it from the reference's states" in replica0["check"]["emulated_on"]
    # for jax, torch: never a backend that declares no emulations (keras-jax sorts first, and is global at dp 2)
    assert emulation(tf, _run("jax", [PER_REPLICA], devices=2), INFO)["change"] == {"devices": 2, "backend": "torch"}
    mean = emulation(tf, _run("tensorflow", [PER_REPLICA], batchnorm=MEAN, devices=2), INFO)
    assert mean["change"] == {"devices": 2} and "emulated_on" not in mean["check"]
    # a reference that keeps replica 0's computes the MEAN by the emulation fault
    torch = emulation(_run("torch"), _run("tensorflow", [PER_REPLICA], batchnorm=MEAN, devices=2), INFO)
    assert torch["change"] == {"devices": 2, "fault": "bn_replica_mean_running_stats"}


def test_a_references_own_formula_is_undone_by_a_third_backend_and_checked_on_another():
    """A Keras reference's own Adam formula against a plain candidate: the candidate is compared with a third
    backend computing the plain formulas from the reference's states (never the candidate's own code, nor the
    reference's), and the reference's own steps with a backend computing its declared formula."""
    got = emulation(_run("keras-jax", declared=KERAS_ADAM), _run("torch"), INFO)
    assert got["change"] == {"backend": "jax"}                       # not torch (the candidate), not keras-jax
    chk = got["check"]
    assert chk["emulated"] == ["adam_epsilon_hat", "keras_float32_betas"] and "skipped" not in chk
    assert chk["reference_check"] == {"differences": ["adam_epsilon_hat", "keras_float32_betas"],
                                      "change": {"backend": "torch", "fault": "adam_eps_hat+adam_float32_betas"}}
    assert "undone" in chk["emulated_on"]
    # a jax candidate: the stand-in is another plain backend again
    assert emulation(_run("keras-jax", declared=KERAS_ADAM), _run("jax"), INFO)["change"] == {"backend": "tensorflow"}
    # nobody else computes the reference's formula: not verified, and said why
    alone = {k: v for k, v in INFO.items() if k != "torch"}
    none = emulation(_run("keras-jax", declared=KERAS_ADAM), _run("jax"), alone)
    assert none["change"] is None and "reference_check" not in none["check"]
    assert none["check"]["skipped_differences"] == ["adam_epsilon_hat", "keras_float32_betas"]
    assert "no installed backend other than keras-jax computes" in none["check"]["skipped"]
    # the same formula on both sides: no difference, nothing undone
    same = emulation(_run("keras-jax", declared=KERAS_ADAM), _run("keras-tensorflow", declared=KERAS_ADAM), INFO)
    assert same["change"] is None and same["check"]["same"] == ["adam_epsilon_hat", "keras_float32_betas"]


def test_a_backend_standing_in_for_a_keras_reference_computes_the_conventions_both_runs_share():
    """A keras-jax reference and a keras-torch candidate share Keras' Adam and running variance; the candidate
    alone pools with replicate padding. keras-jax does not compute that padding, so torch computes it from the
    reference's states, and it must compute the shared Keras formulas too (with the padding alone it stepped with
    the plain Adam both runs lack: a false disagreement)."""
    shared = KERAS_ADAM + [{"id": "running_var_biased"}]
    info = dict(INFO, torch=dict(INFO["torch"], emulations=INFO["torch"]["emulations"] + ["avgpool_replicate_pad"]))
    got = emulation(_run("keras-jax", declared=shared), _run("keras-torch", declared=shared + ["keras_torch_avgpool_same"]),
                    info)
    assert got["change"] == {"backend": "torch",
                             "fault": "adam_eps_hat+adam_float32_betas+avgpool_replicate_pad+bn_running_var_biased"}
    assert got["check"]["emulated"] == ["keras_torch_avgpool_same"]
    assert got["check"]["same"] == ["adam_epsilon_hat", "keras_float32_betas", "running_var_biased"]


def test_a_stand_in_for_a_data_parallel_keras_reference_folds_running_statistics_as_each_side_does():
    """keras-tensorflow at dp 2 (per replica, replica 0's running statistics) as the reference; tensorflow at dp 2
    (the MEAN over its replicas) as the candidate: the stand-in computes the plain formulas per replica with the
    candidate's MEAN, the reference's own steps are checked per replica with the reference's replica 0."""
    keras = KERAS_ADAM + [{"id": "running_var_biased"}, {"id": PER_REPLICA}]
    got = emulation(_run("keras-tensorflow", declared=keras, devices=2, batchnorm="per replica; replica 0's"),
                    _run("tensorflow", declared=[PER_REPLICA], devices=2, batchnorm=MEAN), INFO)
    assert got["change"] == {"devices": 2, "backend": "torch", "fault": "bn_replica_mean_running_stats"}
    assert got["check"]["reference_check"]["change"] == {
        "backend": "torch", "fault": "adam_eps_hat+adam_float32_betas+bn_running_var_biased"}


def test_a_reference_whose_data_parallel_program_has_no_replicas_does_not_emulate_per_replica_statistics():
    """Found as a user (session 33, the AMD VM): `duipai compare resnet_tiny runs -r keras-jax` had keras-tensorflow at
    --devices 2 BUG at `forward: stem_bn`: its per-replica statistics were \"emulated\" by keras-jax at --devices 2,
    whose one GSPMD program normalises over the global batch (286 of 286 probes disagreeing). Now a backend that
    declares emulations computes them from the reference's states, as for torch and tensorflow at --devices 2."""
    kj = _run("keras-jax", KERAS_ADAM)
    got = emulation(kj, _run("keras-tensorflow", KERAS_ADAM + [PER_REPLICA], devices=2), INFO)
    assert got["change"] is not None and got["change"].get("backend") in ("torch", "jax"), got
    assert got["change"]["devices"] == 2
    # a reference whose data-parallel program keeps per-replica statistics still computes them itself
    assert emulation(_run("torch"), _run("jax", [PER_REPLICA], devices=2), INFO)["change"] == {"devices": 2}
