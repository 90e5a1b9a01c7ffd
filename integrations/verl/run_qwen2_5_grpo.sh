#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-3B-Instruct, log-probs and entropy by rl-kernels (verl 0.7.0-0.9.x, FSDP2,
# vLLM rollout, one node of 8 GPUs). The three rl-kernels lines are marked; everything else is
# a plain verl GRPO run. Extra Hydra overrides are appended from the command line, e.g.
#   bash run_qwen2_5_grpo.sh trainer.n_gpus_per_node=4
#   bash run_qwen2_5_grpo.sh --cfg job          # print the composed config and exit
# Data: GSM8K as parquet, e.g. from examples/data_preprocess/gsm8k.py in the verl repository.
set -euo pipefail

PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}

"$PYTHON" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.external_lib=rl_kernels.integrations.verl `# rl-kernels 1/3` \
    actor_rollout_ref.model.use_fused_kernels=True `# rl-kernels 2/3` \
    actor_rollout_ref.model.fused_kernel_options.impl_backend=rl_kernels `# rl-kernels 3/3` \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.logger='["console"]' \
    trainer.project_name=rl_kernels_grpo \
    trainer.experiment_name=qwen2_5_3b_gsm8k_rl_kernels \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=15 \
    "$@"
