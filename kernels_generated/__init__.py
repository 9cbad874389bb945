"""kernels_generated"""
