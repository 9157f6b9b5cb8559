"""Strong and weak scaling of DDP training through the training job, before choosing a process
count: throughput, speedup and efficiency per worker count, and where runs crossed nodes.

    python jobs/scaling_study.py --workers 1,2,4,8
"""
