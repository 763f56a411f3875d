//! kvroute collector (see issue 3).
