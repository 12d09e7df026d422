#!/usr/bin/env bash
# GRPO on Harbor tasks with real agents through rollout-relay (verl 0.9.x, async rollout).
#
#   1. rollout-relay proxy --port 8080 --worker-token "$RELAY_WORKER_TOKEN"
#   2. rollout-relay task-server ...            (runs the agents next to the tasks)
#   3. python -c 'from sdk.harbor_dataset import write_verl_dataset as w; w("tasks/", "train.parquet")'
#   4. this script
#
# rollout.response_length / prompt_length bound what RemoteAgentLoop returns: longer
# trajectories are cut with prompt_truncated / response_truncated set in extra_fields.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-Qwen/Qwen3-4B}"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="${TRAIN_FILES:-train.parquet}" \
    data.val_files="${VAL_FILES:-train.parquet}" \
    data.train_batch_size=32 \
    data.max_prompt_length=4096 \
    data.max_response_length=28672 \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.prompt_length=4096 \
    actor_rollout_ref.rollout.response_length=28672 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loops.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=remote_agent \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    "$@"
