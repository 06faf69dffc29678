"""The bottom layer: errors, pure statistics, the event loop helper, secrets, the hardware table. Imports nothing of
campaign.
"""
