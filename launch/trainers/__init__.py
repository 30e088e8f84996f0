"""Trainers: the only modules that import torch, deepspeed or megatron.core."""
