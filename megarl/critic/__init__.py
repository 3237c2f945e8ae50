"""The critic: a value model trained on each step's rollouts (issue 43; algorithm.advantage gae|vtrace).

Built so far: the value loss (:mod:`megarl.critic.value_loss`). The value model executor and its
wiring into the controller are not built yet (config validation refuses gae/vtrace until then).
"""
