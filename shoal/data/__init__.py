"""Samplers and partitioners that give each rank its share of the data."""

from shoal.data.elastic import ElasticSampler
from shoal.data.partition import DataPartitioner, Partition
from shoal.data.sampler import DistributedSampler

__all__ = ["DataPartitioner", "DistributedSampler", "ElasticSampler", "Partition"]
