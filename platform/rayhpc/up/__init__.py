"""The user's own Ray cluster on this machine: `rayhpc up` starts it, every later command joins it,
`rayhpc down` stops it.

A command otherwise starts a Ray of its own and stops it at its end: seconds of start-up and
shutdown around every sweep or training run. With the cluster up, commands join it instead
(`rayhpc.user_cluster.find`): its address is in a connection file of this user's, one per machine,
`~/.rayhpc/clusters/<host>.json` (0600, in a 0700 folder; `RAYHPC_HOME` moves `~/.rayhpc`), in the
format of a Slurm job's `cluster.json`. The cluster is held by one process (`daemon`): a private
temp folder (random name, 0700), token auth, its own free ports, as every local Ray the platform
starts. A connection file whose cluster is gone is noticed at once (its process or its port are not
there) and the command starts its own Ray, saying so.
"""
