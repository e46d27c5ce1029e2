"""Flag validation: bad values and unsound combinations fail before anything starts."""

import pytest

from fakes import other_value

import estimators
import losses
import main


def _err(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--estimator", "ppo2"], "--estimator 'ppo2' is unknown; choose from"),
    (["--loss", "dpo"], "--loss 'dpo' is unknown"),
    (["--is_level", "seq", "--is_mode", "clip"], "needs --is_mode mask or reject"),
    (["--is_band", "2", "1"], "--is_band 2 1: need 0 <= LOW <= HIGH and HIGH > 0"),
    (["--is_band", "0", "0"], "--is_band 0 0: need 0 <= LOW <= HIGH and HIGH > 0"),
    (["--is_band", "-1", "2"], "--is_band -1 2: need 0 <= LOW"),
    (["--samples_per_prompt", "1"], "needs --samples_per_prompt >= 2"),
    (["--async_depth", "1", "--is_level", "off"], "needs IS correction"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--max_new_tokens", "300", "--max_len", "256"], "--max_new_tokens must be smaller"),
    (["--rollout_in_flight", "2"], "--rollout_in_flight must be >= --prompts_per_step"),
])
def test_bad_flags_are_refused(capsys, tiny_model, argv, message):
    assert message in _err(capsys, ["--model", tiny_model, *argv])


def test_missing_paths_are_named(capsys, tmp_path, tiny_model):
    assert "--model /nope: not a model folder" in _err(capsys, ["--model", "/nope"])
    assert "--agent x.py: no such file" in _err(capsys, ["--model", tiny_model, "--agent", "x.py"])
    assert "--dataset d.jsonl: no such file" in _err(capsys, ["--model", tiny_model, "--dataset", "d.jsonl"])


def test_unknown_flag_is_refused(capsys):
    assert "unrecognized arguments: --lr_schedule" in _err(capsys, ["--lr_schedule", "cos"])


@pytest.mark.parametrize("argv, message", [
    (["--kl_coef", "0.1"], "say where the KL goes"),
    (["--kl_loss"], "need --kl_coef > 0"),
    (["--kl_coef", "0.1", "--kl_loss", "--kl_in_reward"], "not both"),
    (["--kl_coef", "0.1", "--kl_in_reward"], "--estimator grpo normalizes a sequence reward"),
    (["--estimator", "on_policy_distill"], "needs a teacher (--ref_model PATH)"),
    (["--critic_lr", "1e-4"], "only apply to an estimator with a critic"),
    (["--kl_estimator", "k4"], "--kl_estimator 'k4' is unknown"),
    (["--loss_agg", "sum"], "--loss_agg 'sum' is unknown"),
    # KL estimators only where their gradient is a KL's gradient (losses.KL_PLACEMENTS)
    (["--estimator", "reinforce_pp", "--kl_coef", "0.1", "--kl_in_reward", "--kl_estimator", "k3"],
     "--kl_estimator k3 with --kl_in_reward: as a reward penalty"),
    (["--estimator", "reinforce_pp", "--kl_coef", "0.1", "--kl_in_reward", "--kl_estimator", "k2"], "use k1"),
    (["--kl_coef", "0.1", "--kl_loss", "--kl_estimator", "k1"], "--kl_estimator k1 with --kl_loss: as a loss"),
    (["--kl_estimator", "k2"], "--kl_estimator needs --kl_loss or --kl_in_reward"),
    (["--top_p", "0.9"], "--top_p 0.9 with IS correction"),
    (["--eps_clip", "1.5", "0.2"], "--eps_clip LOW must be in [0, 1]"),
    (["--ref_model", "/nope", "--kl_coef", "0.1", "--kl_loss"], "--ref_model /nope: not a model folder"),
])
def test_unsound_algorithm_combinations_are_refused(capsys, tiny_model, argv, message):
    assert message in _err(capsys, ["--model", tiny_model, *argv])


@pytest.mark.parametrize("argv, key, value", [
    (["--estimator", "reinforce_pp", "--kl_coef", "0.1", "--kl_in_reward"], "kl_estimator", "k1"),
    (["--kl_coef", "0.1", "--kl_loss"], "kl_estimator", "k2"),
    (["--kl_coef", "0.1", "--kl_loss", "--kl_estimator", "k3"], "kl_estimator", "k3"),
    ([], "eps_clip", [0.2, 0.2]),
    ([], "loss_agg", "token_mean"),
    (["--loss", "cispo"], "eps_clip", [None, 0.2]),          # MiniMax-M1: no lower bound
    (["--loss", "cispo", "--eps_clip", "0.1", "2"], "eps_clip", [0.1, 2.0]),
    # GSPO as published: the geometric-mean ratio's clip range and sequence-mean aggregation
    (["--loss", "gspo"], "eps_clip", [3e-4, 4e-4]),
    (["--loss", "gspo"], "loss_agg", "seq_mean_token_mean"),
    (["--loss", "gspo", "--eps_clip", "0.2", "0.2"], "eps_clip", [0.2, 0.2]),
    (["--loss", "gspo", "--loss_agg", "token_mean"], "loss_agg", "token_mean"),
    (["--top_p", "0.9", "--is_level", "off"], "top_p", 0.9),
    # the engine's logprobs are the old policy's only where it samples the full softmax in float32, on-policy
    (["--param_dtype", "float32"], "old_logprobs", "engine"),
    (["--param_dtype", "float32", "--top_p", "0.9", "--is_level", "off"], "old_logprobs", "recompute"),
    (["--param_dtype", "bfloat16"], "old_logprobs", "recompute"),
])
def test_algorithm_defaults_are_filled_soundly(tiny_model, argv, key, value):
    assert main.validate(vars(main.build_parser().parse_args(["--model", tiny_model, *argv])))[key] == value


@pytest.mark.parametrize("argv, message", [
    (["--partial_rollout"], "only changes anything with --async_depth >= 1"),
    (["--partial_rollout", "--async_depth", "1", "--is_level", "off"], "needs IS correction"),
    (["--replay_rollouts", "/nonexistent"], "no step_*.jsonl files"),
    (["--resume", "--output_dir", "/tmp/molt-never-ran"], "--resume: no complete checkpoint"),
    (["--keep_checkpoints", "0"], "--keep_checkpoints must be >= 1"),
    (["--branches", "2", "--agent", main.__file__.replace("main.py", "examples/agents/chat_openai.py")],
     "RunningMax is not an Env"),
    (["--branch_turns", "2"], "--branch_turns [2]: needs --branches > 1"),
    (["--branches", "2", "--branch_turns", "0"], "turns >= 1"),
    (["--branches", "0"], "--branches must be >= 1"),
    (["--old_logprobs", "engine", "--top_p", "0.5", "--is_level", "off"], "--old_logprobs engine with --top_p 0.5"),
])
def test_unsound_loop_combinations_are_refused(capsys, tiny_model, argv, message):
    assert message in _err(capsys, ["--model", tiny_model, *argv])


@pytest.mark.parametrize("why, dtype", [("this CPU has avx512_bf16", "bfloat16"), (None, "float32")])
def test_param_dtype_auto_follows_the_device(tiny_model, monkeypatch, why, dtype):
    """bf16 only where it is native (a GPU, AMX or AVX512-BF16): on an AVX2-only CPU it is
    emulated and far slower than fp32."""
    monkeypatch.setattr(main, "native_bf16", lambda: why)
    cfg = main.validate(vars(main.build_parser().parse_args(["--model", tiny_model, "--param_dtype", "auto"])))
    assert cfg["param_dtype"] == dtype


def _validate(tiny_model, argv):
    return main.validate(vars(main.build_parser().parse_args(["--model", tiny_model, *argv])))


# ---------------------------------------------------------------- every loss and estimator by its entry
# What a loss or an estimator defaults to and refuses is declared in its entry (losses.POLICY_LOSSES,
# estimators.ESTIMATORS); these tests cover every entry, a new one included, with no list to extend.

@pytest.mark.parametrize("name", losses.POLICY_LOSSES)
def test_each_loss_gets_its_declared_defaults_unless_the_flags_are_given(capsys, tiny_model, name):
    spec = losses.POLICY_LOSSES[name]
    cfg = _validate(tiny_model, ["--loss", name])
    assert cfg["eps_clip"] == (spec.eps_clip and list(spec.eps_clip)) and cfg["loss_agg"] == spec.loss_agg
    eps = ["--eps_clip", "0.1", "0.3"]
    if spec.eps_clip is None:
        assert "has no clip range: drop --eps_clip" in _err(capsys, ["--model", tiny_model, "--loss", name, *eps])
        eps = []
    cfg = _validate(tiny_model, ["--loss", name, *eps, "--loss_agg", "seq_mean_token_sum"])
    assert cfg["eps_clip"] == ([0.1, 0.3] if eps else None) and cfg["loss_agg"] == "seq_mean_token_sum"


@pytest.mark.parametrize("name", losses.POLICY_LOSSES)
def test_each_loss_refuses_cp_exactly_when_its_entry_does(capsys, tiny_model, name):
    why, flags = losses.POLICY_LOSSES[name].no_cp, ["--train_workers", "2", "--cp_size", "2"]
    if why:
        assert why in _err(capsys, ["--model", tiny_model, "--loss", name, *flags])
    else:
        _validate(tiny_model, ["--loss", name, *flags])


OWN = [(flag, entry, name) for flag, registry in (("estimator", estimators.ESTIMATORS), ("loss", losses.POLICY_LOSSES))
       for entry, spec in registry.items() for name in spec.settings]


@pytest.mark.parametrize("flag, entry, name", OWN, ids=[f"{e}-{n}" for _, e, n in OWN])
def test_an_entry_s_own_setting_is_a_flag_checked_by_its_bounds_and_refused_elsewhere(capsys, tiny_model, flag,
                                                                                      entry, name):
    s = main.own_settings()[name][0]
    base = ["--model", tiny_model, f"--{flag}", entry]
    base += ["--ref_model", tiny_model, "--kl_coef", "0.1"] if flag == "estimator" and \
        estimators.ESTIMATORS[entry].teacher else []
    assert f"--{name}" in main.build_parser().format_help()
    assert _validate(tiny_model, base[2:])[name] == s.default
    assert _validate(tiny_model, [*base[2:], f"--{name}", str(other_value(s))])[name] == other_value(s)
    for bad in ((s.low - 1) if s.low is not None else None, (s.high + 1) if s.high is not None else None):
        if bad is not None:
            assert f"--{name} must be {s.bounds()}" in _err(capsys, [*base, f"--{name}", str(s.type(bad))])
    registry = estimators.ESTIMATORS if flag == "estimator" else losses.POLICY_LOSSES
    others = [e for e, spec in registry.items() if name not in spec.settings]
    for other in others[:1]:
        teacher = ["--ref_model", tiny_model, "--kl_coef", "0.1"] if flag == "estimator" and \
            estimators.ESTIMATORS[other].teacher else []
        assert f"--{name} is a setting of" in _err(capsys, ["--model", tiny_model, f"--{flag}", other, *teacher,
                                                            f"--{name}", str(other_value(s))])
        assert _validate(tiny_model, [f"--{flag}", other, *teacher])[name] is None   # nothing to pass on


@pytest.mark.parametrize("name", estimators.ESTIMATORS)
def test_each_estimator_is_checked_by_its_entry(capsys, tiny_model, name):
    spec = estimators.ESTIMATORS[name]
    teacher = ["--ref_model", tiny_model, "--kl_coef", "0.1"] if spec.teacher else []
    est = ["--model", tiny_model, "--estimator", name, *teacher]
    _validate(tiny_model, est[2:])
    if spec.min_group > 1:
        assert f"needs --samples_per_prompt >= {spec.min_group}" in _err(
            capsys, [*est, "--samples_per_prompt", str(spec.min_group - 1)])
    _validate(tiny_model, [*est[2:], "--samples_per_prompt", str(spec.min_group)])
    if spec.teacher:
        assert "needs a teacher (--ref_model PATH)" in _err(capsys, ["--model", tiny_model, "--estimator", name])
        assert "already uses the KL as its advantage" in _err(capsys, [*est, "--kl_loss"])
    else:
        kl = [*est, "--kl_coef", "0.1", "--kl_in_reward"]
        if spec.no_kl_in_reward:
            assert spec.no_kl_in_reward in _err(capsys, kl)
        else:
            assert _validate(tiny_model, kl[2:])["kl_estimator"] == "k1"
    if spec.critic:
        _validate(tiny_model, [*est[2:], "--critic_lr", "1e-4"])
    else:
        assert "only apply to an estimator with a critic" in _err(capsys, [*est, "--critic_lr", "1e-4"])
