"""Resolve recipes, plan memory and communication, launch trainers. No torch import outside trainers."""
