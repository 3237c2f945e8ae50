"""The critic: a value model trained on each step's rollouts (issue 43; algorithm.advantage gae|vtrace).

- :mod:`megarl.critic.value_loss`: the clipped value loss and its metrics (critic/value_loss, critic/explained_var);
- :mod:`megarl.critic.model`: the policy's Megatron GPTModel with a scalar head, its forward and update;
- :mod:`megarl.critic.learner`: one critic rank's learner (model, optimizer, checkpoint/resume/reshard);
- :mod:`megarl.critic.config`: the ``critic:`` knobs (torch-free);
- :mod:`megarl.critic.targets`: a step's per-token advantages and the critic's targets from its values;
- :mod:`megarl.critic.executor`: its ranks as their own process group, started by the controller
  (``make_critic``) with algorithm.advantage gae or vtrace, checkpointed and resumed with the trainer.
"""
