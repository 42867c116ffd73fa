"""The ranks: agreement, the notice board and its waits (above ``step``).

- ``agreement``: the step check at the end of every backward and the fetch
  comparisons (``RanksDisagree``);
- ``rank_watch``: ``RankWatch``, the notice board of one engine and the waits
  that watch it (``RankFailed``); ``watcher``: its thread on backends whose
  waits do not block the host;
- ``fetch_agreement``: forward fetches that no trace vouches for, and those of
  eval forwards, agreed;
- ``uneven``: eval forwards meet on the notice board, and open their fetch comparisons;
- ``topology``: which ranks share the shards, which hold replicas of them
  (HSDP / MiCS over a (replicate, shard) ``DeviceMesh``), and which group
  carries what.
"""
