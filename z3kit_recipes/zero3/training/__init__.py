"""The data path's parts (above ``ranks``): each stage of the lifecycles in
the design notes, built and tested on its own.

- parameters: ``layout`` (the shards and fp32 masters), ``materialize``
  (models built on meta), ``hook_plan`` (which module gathers what),
  ``params`` (the ``ParamCoordinator``), ``holds`` (which modules and pins
  hold each parameter), ``gathers`` (the ``Gatherer``, the one owner of
  gathers in flight), ``schedule`` (the backward fetches), ``rounds``
  (rank-divergent graphs), ``param_use`` (parameters used outside their
  module);
- gradients: ``grads`` (the ``GradReducer``), ``reductions`` (the one
  owner of reductions in flight), ``reduction_plan``, ``grad_window``,
  ``backward`` (the ``BackwardPass`` and the module hooks),
  ``backward_once``, ``step_checks``, ``optim_step``, ``trainable``
  (unfreezing);
- around them: ``timeline``, ``model_watch``.
"""
