"""What runs inside Megatron's training step: the TeraPipe schedule, with the signature of
Megatron's own (forward_backward.py); the getter hook that routes Megatron to it (install.py);
which plan runs, as config.terapipe (selection.py); `--pipeline-schedule auto`'s measured
choice between schedules (measured_choice.py, timed and agreed across ranks by
trial_timing.py); the stage-to-stage transport through Megatron's P2P (p2p.py); and
Megatron-LM's forward step per cell (lm_cells.py). The model's layers are model/, the rules of
what runs support/, the version checks and CPU mode platform/.

May import: plan, schedule, runtime, megatron.platform, megatron.support, megatron.model, megatron.hooks
"""
