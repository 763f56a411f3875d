//! engine simulator (see issue 6).
