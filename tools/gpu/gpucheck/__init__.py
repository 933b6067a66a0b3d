"""`tools/gpu/check`: does a job on this host see exactly the GPU it was lent?"""
