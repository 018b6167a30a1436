"""Reusable measurements that several checks share. These modules import torch."""
