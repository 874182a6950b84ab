"""The algebra: segment operators (T, E), what a cached segment is (SegmentEntry) and how it is keyed."""
