//! SVG.
