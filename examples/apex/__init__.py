"""Ape-X (Horgan et al. 2018) on gymnasium's CartPole-v1 with a neuroshard replay table.

Actor processes insert n-step transitions with initial priorities; one learner samples by
priority, trains a double DQN with importance weights and writes |TD error| back as
strengths. See README "Replay tables: an Ape-X learner".
"""
